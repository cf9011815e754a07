"""TorchGenerationBackend against independent references: HF `generate`, a fresh HF forward pass, a
backend built from the new weights, a float64 top-k / top-p filter (conftest's `hf_ref.filter_bounds`), and
the shared contract of rl_core.testing.contracts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_core.importance import importance_weights
from rl_core.interfaces import SamplingParams
from rl_core.testing.contracts import check_generation_backend
from rl_core.testing.tiny_models import cached_tiny_checkpoint
from rollout.sampling import filter_logits
from rollout.torch_backend import TorchGenerationBackend

EOS = 2
# Both decode paths; paged with small blocks (prompts span several blocks and end mid-block) and 3 rows at a
# time (continuous batching refills rows while others decode).
DECODE_PATHS = {"dense": dict(decode="dense"), "paged": dict(decode="paged", block_size=4, max_num_seqs=3)}


@pytest.mark.parametrize("decode", DECODE_PATHS)
@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_equals_hf_generate(arch, decode, model_cache, prompts, hf_ref):
    path = cached_tiny_checkpoint(arch, seed=3, cache_dir=model_cache)
    backend = TorchGenerationBackend(str(path), **DECODE_PATHS[decode])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=20))
    for prompt, completion in zip(prompts, out):
        expected = hf_ref.greedy(hf, prompt, 20)
        assert completion.token_ids == expected
        assert completion.finish_reason == ("stop" if expected[-1] == EOS else "length")
        # Greedy reports logprobs at T = 1.
        ref = hf_ref.logprobs(hf, prompt, completion.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("decode", DECODE_PATHS)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_equal_hf_forward(tiny_ckpt, prompts, temperature, top_k, top_p, decode, hf_ref):
    backend = TorchGenerationBackend(str(tiny_ckpt), **DECODE_PATHS[decode])
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=7)
    out = backend.generate(prompts, params)
    gen, prev = [], []
    for c in out:
        gen.append(torch.tensor(c.logprobs))
        prev.append(hf_ref.logprobs(hf, prompts[c.prompt_index], c.token_ids, temperature, top_k, top_p))
    gen_t, prev_t = torch.cat(gen), torch.cat(prev)
    assert (gen_t - prev_t).abs().max() <= 1e-5
    assert [c.prompt_index for c in out] == [i for i in range(len(prompts)) for _ in range(4)]
    assert len({tuple(c.token_ids) for c in out[:4]}) > 1  # the n samples of a prompt differ
    seq_ids = torch.cat([torch.full((len(g),), i) for i, g in enumerate(gen)])
    _, metrics = importance_weights(prev_t, gen_t, torch.ones_like(gen_t), seq_ids)
    assert float(metrics["token_mult_prob_error"]) <= 1.0001
    assert abs(float(metrics["gen_kl"])) <= 1e-5


@pytest.mark.parametrize("limits", [dict(max_num_seqs=3), dict(max_batch_tokens=100)])
def test_dense_decoding_splits_a_prompts_samples_that_exceed_the_row_limit(tiny_ckpt, prompts, hf_ref, limits):
    """n = 5 > max_num_seqs = 3 (or more rows than max_batch_tokens holds): a prompt's samples are decoded in
    consecutive chunks within the limit, prompt-major, each with the HF forward's logprobs (eval --samples 64 used
    to decode all 64 rows of a prompt at once)."""
    backend = TorchGenerationBackend(str(tiny_ckpt), decode="dense", **limits)
    longest = max(len(p) for p in prompts[:2]) + 8
    max_rows = limits.get("max_num_seqs") or limits["max_batch_tokens"] // longest
    chunk_rows = []
    decode_chunk = backend._generate_chunk

    def spy(chunk, params, *args):
        chunk_rows.append(len(chunk) * params.n)
        return decode_chunk(chunk, params, *args)

    backend._generate_chunk = spy
    out = backend.generate(prompts[:2], SamplingParams(n=5, temperature=1.0, max_new_tokens=8, seed=1))
    assert sum(chunk_rows) == 10 and max(chunk_rows) <= max_rows < 5, chunk_rows
    assert [c.prompt_index for c in out] == [0] * 5 + [1] * 5
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for c in out:
        ref = hf_ref.logprobs(hf, prompts[c.prompt_index], c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def _filter_test_logits(vocab: int) -> torch.Tensor:
    """Rows for the filter: continuous logits, logits on a coarse grid (ties everywhere, boundaries included,
    as in bf16), one row all tied, peaked rows, huge magnitudes, rows with -inf (tokens masked upstream)."""
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(16, vocab, generator=g) * 3
    coarse = (torch.randn(16, vocab, generator=g) * 3).round() / 2
    peaked = torch.randn(2, vocab, generator=g)
    peaked[0, 7], peaked[1, 3] = 1e4, 8.0
    huge = torch.randn(2, vocab, generator=g) * 1e4
    masked = coarse[:4].clone()
    masked[:, ::3] = float("-inf")
    return torch.cat([smooth, coarse, torch.zeros(1, vocab), peaked, huge, masked])


def test_top_k_top_p_filter_equals_a_float64_reference(hf_ref):
    """sampling.filter_logits keeps exactly the tokens HF's warpers / vLLM keep, and with ties at the top-p
    boundary all of them (where those keep some, by sort order), on logits with ties and edge settings
    (0 / >= V / 1 = off, top_p -> 0)."""
    vocab = 40
    logits = _filter_test_logits(vocab)
    settings = [(0, 1.0), (vocab, 1.0), (vocab + 5, 0.7), (1, 1.0), (2, 1.0), (7, 1.0), (vocab - 1, 1.0),
                (0, 0.5), (0, 0.9), (0, 0.999), (0, 1e-9), (2, 0.3), (5, 0.8), (vocab - 1, 0.95), (10, 0.6)]
    checked = ambiguous = tie_bound = 0
    for top_k, top_p in settings:
        out = filter_logits(logits, top_k, top_p)
        kept = torch.isfinite(out)
        assert torch.equal(out[kept], logits[kept])  # kept logits pass through unchanged
        for row in range(len(logits)):
            must, may, count = hf_ref.filter_bounds(logits[row], 1.0, top_k, top_p)
            if top_p < 1.0:  # a prefix mass within float32 rounding of top_p: either count is right
                lo, hi = (hf_ref.filter_bounds(logits[row], 1.0, top_k, q)[2] for q in (top_p - 1e-5, top_p + 1e-5))
                if lo != hi:
                    ambiguous += 1
                    continue
            where = f"top_k={top_k} top_p={top_p} row {row}"
            assert int(kept[row].sum()) >= count, where
            assert torch.equal(kept[row], may), f"{where}: {(kept[row] ^ may).nonzero().flatten().tolist()} differ"
            checked, tie_bound = checked + 1, tie_bound + int(not torch.equal(must, may))
    assert ambiguous <= 10 and checked > 600 and tie_bound > 20  # ties at the boundaries were exercised
    # HF / vLLM keep every token tied with the k-th largest; the nucleus is >= top_p of the top-k mass.
    hand = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    assert torch.isfinite(filter_logits(hand, 2, 1.0)).nonzero()[:, 1].tolist() == [0, 1, 2, 3]
    # p = .43, .16, .16, .16, ...: the nucleus needs one of the three tied tokens, and keeps all three
    assert torch.isfinite(filter_logits(hand, 0, 0.45)).sum() == 4
    assert torch.isfinite(filter_logits(hand, 0, 0.42)).sum() == 1
    assert torch.isfinite(filter_logits(hand, 2, 0.6)).sum() == 4  # of the 4 top-2 tokens: p = .48, .17, ...


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 1.0), (0, 0.9), (20, 0.9)])
def test_sampling_reads_no_value_on_the_host(top_k, top_p):
    """The paged decoder captures sampling in a CUDA graph (top-k / top-p included), where a host read of a
    device value (`.item()`, `bool(t)`, a boolean mask index) fails the capture: none here, at a vocabulary
    larger than the engines' top-p candidate count (whose fallback does read one)."""
    from rl_core.testing.host_reads import HostReads
    from rollout.sampling import row_keys, sample_next

    class Sampler(torch.nn.Module):
        def forward(self, logits):
            params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
            keys = row_keys(7, torch.arange(logits.shape[0]))
            return sample_next(logits, params, keys_B=keys, steps_B=torch.zeros_like(keys))

    sampler = Sampler()
    logits = torch.randn(4, 3000) * 0.1  # flat: 1024 candidates hold less than top_p
    sampler(logits)  # warm-up, as before a capture: a one-time (cached) check of the int32 hash reads one
    with HostReads([sampler]) as reads:
        tokens, logprobs = sampler(logits)
    assert reads.count == 0, reads.where
    assert torch.isfinite(logprobs).all() and tokens.shape == (4,)


@pytest.mark.parametrize("decode", DECODE_PATHS)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 3, 1.0), (0.7, 0, 0.5)], ids=["top-k-3", "top-p-0.5"])
def test_sampled_tokens_lie_in_the_hf_top_k_top_p_set(tiny_ckpt, prompts, hf_ref, decode, temperature, top_k, top_p):
    """Every sampled token is in the top-k / nucleus set of a fresh HF forward (float64 softmax of logits / T),
    and its reported logprob is that of the truncated, renormalised distribution it was drawn from (as vLLM's
    processed_logprobs and the engines with policy.top_k / top_p), not the full-vocabulary one."""
    backend = TorchGenerationBackend(str(tiny_ckpt), **DECODE_PATHS[decode])
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=3)
    out = backend.generate(prompts, params)
    raw, renormalised, outside_mass = [], [], []
    for c in out:
        prompt = prompts[c.prompt_index]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].double()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        for pos, token in enumerate(c.token_ids):
            _, may, _ = hf_ref.filter_bounds(logits[pos], temperature, top_k, top_p, tol=1e-4)
            assert may[token], f"prompt {c.prompt_index} position {pos}: token {token} outside the top-k/top-p set"
            _, exact, _ = hf_ref.filter_bounds(logits[pos], temperature, top_k, top_p)
            raw.append(logp[pos, token])
            renormalised.append(logp[pos, token] - torch.logsumexp(logp[pos][exact], 0))
            outside_mass.append(1 - logp[pos][exact].exp().sum())
    reported = torch.tensor([x for c in out for x in c.logprobs], dtype=torch.float64)
    torch.testing.assert_close(reported, torch.stack(renormalised), atol=1e-5, rtol=0)
    assert (reported - torch.stack(raw)).abs().min() > 0.05  # the two conventions are told apart
    # An unfiltered sampler would leave the set with this probability at each of the ~240 tokens.
    assert torch.stack(outside_mass).mean() > 0.3


def test_update_weights_equals_backend_built_from_new_weights(tiny_ckpt, tiny_ckpt_other, prompts):
    refit = TorchGenerationBackend(str(tiny_ckpt))
    fresh = TorchGenerationBackend(str(tiny_ckpt_other))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=11)
    before = refit.generate(prompts, params)
    refit.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after, expected = refit.generate(prompts, params), fresh.generate(prompts, params)
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.logprobs for c in after] == [c.logprobs for c in expected]  # exactly
    assert [c.token_ids for c in after] != [c.token_ids for c in before]  # the refit changed something


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_update_weights_takes_checkpoint_names_of_fused_moe_weights(arch, model_cache):
    """A refit sends checkpoint names (per-expert tensors; Mixtral's `block_sparse_moe`), which transformers
    fuses / renames in memory: the backend ends with exactly the weights `from_pretrained` loads."""
    old = TorchGenerationBackend(str(cached_tiny_checkpoint(arch, seed=1, cache_dir=model_cache)))
    new_path = cached_tiny_checkpoint(arch, seed=2, cache_dir=model_cache)
    stored = list(load_file(new_path / "model.safetensors").items())
    assert any(".experts.0." in name for name, _ in stored)  # per-expert on disk
    old.update_weights(reversed(stored))  # any order: a fused weight's pieces may arrive apart
    expected = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32).state_dict()
    got = old.model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    with pytest.raises(ValueError, match="parts of fused weights were not sent"):
        old.update_weights([(n, t) for n, t in stored if ".experts.0.up_proj" not in n and ".experts.0.w3" not in n])


def test_update_weights_rejects_unknown_names_and_shapes(tiny_ckpt):
    backend = TorchGenerationBackend(str(tiny_ckpt))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight.*not a weight"):
        backend.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"lm_head.weight.*shape \(3, 4\).*expects \(128, 128\)"):
        backend.update_weights([("lm_head.weight", torch.zeros(3, 4))])


def test_contract(tiny_ckpt, prompts):
    check_generation_backend(TorchGenerationBackend(str(tiny_ckpt)), prompts, eos_token_id=EOS)


def test_finished_rows_are_dropped_from_the_batch(tiny_ckpt, prompts):
    """Rows that stop leave the decode batch; results equal a run that never compacts."""
    backend = TorchGenerationBackend(str(tiny_ckpt), compact_fraction=1e-6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    base = backend.generate(prompts, greedy)
    # Stop on the 2nd token of prompt 0's greedy continuation: that row must finish early.
    stop = base[0].token_ids[1]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    batch_sizes: list[int] = []
    hook = backend.model.register_forward_pre_hook(
        lambda mod, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    out = backend.generate(prompts, params)
    hook.remove()
    assert out[0].finish_reason == "stop" and out[0].token_ids[-1] == stop and len(out[0].token_ids) <= 2
    assert min(batch_sizes[1:]) < len(prompts), f"no compaction happened: {batch_sizes}"
    lazy = TorchGenerationBackend(str(tiny_ckpt), compact_fraction=1.0)
    ref = lazy.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    for a, b in zip(out, ref):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_chunking_and_top_k_one(tiny_ckpt, prompts):
    """Chunks of 2 rows give the unchunked greedy output; top_k=1 sampling is greedy."""
    whole = TorchGenerationBackend(str(tiny_ckpt))
    chunked = TorchGenerationBackend(str(tiny_ckpt), max_num_seqs=2)
    greedy = whole.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))
    assert [c.token_ids for c in chunked.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10))] \
        == [c.token_ids for c in greedy]
    top1 = whole.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10, seed=0))
    assert [c.token_ids for c in top1] == [c.token_ids for c in greedy]


def test_seed_changes_samples_and_sleep_level_2_reloads(tiny_ckpt, prompts):
    backend = TorchGenerationBackend(str(tiny_ckpt))
    a = backend.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=1))
    b = backend.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=2))
    assert [c.token_ids for c in a] != [c.token_ids for c in b]
    backend.sleep(level=2)
    with pytest.raises(RuntimeError, match="wake"):
        backend.generate(prompts, SamplingParams(max_new_tokens=2))
    backend.wake()
    assert [c.token_ids for c in backend.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=1))] == \
        [c.token_ids for c in a]


def test_bad_sampling_params_and_prompts(tiny_ckpt):
    backend = TorchGenerationBackend(str(tiny_ckpt))
    with pytest.raises(ValueError, match="top_p"):
        backend.generate([[1, 2]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\].*outside the vocabulary"):
        backend.generate([[1, 2], [1, 999]], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] is empty"):
        backend.generate([[]], SamplingParams())
    # 1e-39: logits / T overflowed float32: NaN logprobs on token 0, or an index error under top_p
    with pytest.raises(ValueError, match=r"temperature=1e-39 is below 1e-05 .* use 0 for greedy decoding"):
        backend.generate([[1, 2]], SamplingParams(temperature=1e-39, top_p=0.9))
    assert backend.generate([[1, 2]], SamplingParams(temperature=1e-5, max_new_tokens=2))[0].logprobs[0] <= 0


@pytest.mark.parametrize("decode", DECODE_PATHS)
def test_no_prompts_give_no_completions(tiny_ckpt, decode):
    backend = TorchGenerationBackend(str(tiny_ckpt), **DECODE_PATHS[decode])
    assert backend.generate([], SamplingParams(n=2, max_new_tokens=4)) == []


def test_preallocated_cache_and_gqa_attention_match_transformers_defaults(tiny_ckpt, prompts):
    """rollout's in-place KV cache (also when it must grow) + rollout_sdpa == DynamicCache + sdpa."""
    from transformers import DynamicCache

    from rollout import attention
    from rollout.kv_cache import make_cache

    attention.register()
    ref = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32, attn_implementation="sdpa").eval()
    ours = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32,
                                                attn_implementation="rollout_sdpa").eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = (ids != 0).long()
    caches = {"ref": DynamicCache(config=ref.config), "ours": make_cache(ours.config, capacity=width + 1)}
    with torch.no_grad():
        for step in range(4):  # prefill, then 3 decode steps: the capacity of width + 1 must grow
            pos = attn.cumsum(-1)[:, -ids.shape[1]:] - 1 if step == 0 else attn.sum(-1, keepdim=True) - 1
            outs = {name: model(input_ids=ids, attention_mask=attn, position_ids=pos.clamp(min=0),
                                past_key_values=caches[name]).logits[:, -1]
                    for name, model in (("ref", ref), ("ours", ours))}
            torch.testing.assert_close(outs["ours"], outs["ref"], atol=1e-5, rtol=0)
            ids = outs["ref"].argmax(-1, keepdim=True)
            attn = torch.cat([attn, torch.ones_like(ids)], dim=-1)
    assert caches["ours"].get_seq_length() == width + 3


def test_backends_are_found_through_the_registry(tiny_ckpt):
    import importlib.util

    from rl_core.registry import create_generation_backend

    backend = create_generation_backend("torch", model_path=str(tiny_ckpt))
    assert isinstance(backend, TorchGenerationBackend)
    if importlib.util.find_spec("vllm") is None:  # the uv workspace: vllm is an optional extra
        with pytest.raises(ImportError, match=r"pip install 'rl-rollout\[vllm\]'"):
            create_generation_backend("vllm", model_path=str(tiny_ckpt))


def test_vllm_refit_checks_names_and_shapes_against_the_checkpoint(tiny_ckpt):
    """The vLLM backend's strict refit check (runs without vLLM: headers of the safetensors only)."""
    from rollout.vllm_backend import check_named_tensors, checkpoint_shapes

    shapes = checkpoint_shapes(str(tiny_ckpt))
    weights = load_file(tiny_ckpt / "model.safetensors")
    assert shapes == {name: tuple(t.shape) for name, t in weights.items()}
    seen = []
    assert len(list(check_named_tensors(weights.items(), shapes, "ckpt", seen))) == len(weights) == len(seen)
    with pytest.raises(ValueError, match="'model.bogus.weight' is not a weight of ckpt"):
        list(check_named_tensors([("model.bogus.weight", torch.zeros(1))], shapes, "ckpt"))
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(2, 2\); the model expects \(128, 128\)"):
        list(check_named_tensors([("lm_head.weight", torch.zeros(2, 2))], shapes, "ckpt"))


def test_attention_softcap_needs_eager_dense_decoding(tmp_path, prompts, hf_ref):
    """sdpa, rollout_sdpa and the paged kernels ignore Gemma 2's attention soft-cap: such a model is refused
    unless eager attention on the dense path, which then greedy-decodes what HF's eager model does."""
    from rl_core.testing.tiny_models import SOFTCAPPED_GEMMA2, save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "gemma2", "gemma2", **SOFTCAPPED_GEMMA2)
    with pytest.raises(ValueError, match=r"set attn_implementation=eager and decode=dense"):
        TorchGenerationBackend(str(path))
    with pytest.raises(ValueError, match=r"set backend_kwargs.attn_implementation=eager and backend_kwargs.decode=dense"):
        TorchGenerationBackend.check_model(str(path), {}, prefix="backend_kwargs.")  # no weights read
    TorchGenerationBackend.check_model(str(path), {"attn_implementation": "eager", "decode": "dense"})
    backend = TorchGenerationBackend(str(path), attn_implementation="eager", decode="dense")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert [c.token_ids for c in out] == [hf_ref.greedy(hf, p, 8) for p in prompts]


@pytest.mark.gpu
def test_greedy_equals_hf_generate_on_cuda(tiny_ckpt, prompts, hf_ref):
    backend = TorchGenerationBackend(str(tiny_ckpt), device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [c.token_ids for c in out] == [hf_ref.greedy(hf, p, 16) for p in prompts]
    backend.sleep(level=1)
    assert next(backend.model.parameters()).device.type == "cpu"
    backend.wake()
    assert [c.token_ids for c in backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))] == \
        [c.token_ids for c in out]


@pytest.mark.gpu
def test_refit_while_asleep_loads_on_the_gpu(tiny_ckpt, prompts, hf_ref):
    """The colocated refit (grpo_app.colocation) reaches a sleeping generator: its weights wake to the GPU and
    the new ones are copied there; after wake() it generates what HF does with the new weights."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    backend = TorchGenerationBackend(str(tiny_ckpt), device="cuda")
    backend.sleep(level=1)
    backend.update_weights((name, t.to("cuda")) for name, t in hf.state_dict().items())
    assert next(backend.model.parameters()).device.type == "cuda"
    backend.wake()
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [c.token_ids for c in out] == [hf_ref.greedy(hf, p, 16) for p in prompts]


def test_paged_prefill_gives_the_packed_attention_its_lengths(tiny_ckpt, prompts, monkeypatch):
    """Prefill's cu_seqlens is an inference tensor, which seqpack re-reads on the host in every layer (fp32 on
    CUDA waits for the GPU each time); prefill has the lengths on the host and passes them."""
    import seqpack.attention

    reads = []
    real = seqpack.attention._host_lengths
    monkeypatch.setattr(seqpack.attention, "_host_lengths", lambda cu: reads.append(cu) or real(cu))
    backend = TorchGenerationBackend(str(tiny_ckpt), **DECODE_PATHS["paged"])
    dense = TorchGenerationBackend(str(tiny_ckpt), **DECODE_PATHS["dense"])
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    assert [c.token_ids for c in backend.generate(prompts, params)] == [c.token_ids for c in dense.generate(prompts, params)]
    assert reads == []


def test_a_model_whose_configs_name_no_eos_stops_on_its_tokenizers(tmp_path):
    """Without eos_token_id in config.json and generation_config.json every completion ran to max_new_tokens
    (truncated_fraction 1.0, no warning); vLLM stops on the tokenizer's EOS, and so does this backend now."""
    import json
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "no-eos"
    shutil.copytree(cached_tiny_checkpoint("qwen2"), model)
    for name in ("config.json", "generation_config.json"):
        if (model / name).exists():
            data = json.loads((model / name).read_text())
            data.pop("eos_token_id", None)
            (model / name).write_text(json.dumps(data))
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    assert eos is not None
    assert TorchGenerationBackend(model).eos_token_ids == [eos]
