"""The paged decode path (paged KV cache, prefix sharing, continuous batching, static-shape buckets) against
independent references: the one-batch run, exact-size batches, a fresh forward on CUDA. Greedy == HF
`generate` and logprobs == a fresh HF forward run for both decode paths in test_torch_backend.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_core.importance import importance_weights
from rl_core.interfaces import SamplingParams
from rl_core.testing.contracts import check_generation_backend
from rl_core.testing.tiny_models import cached_tiny_checkpoint
from rollout.paged_cache import BlockAllocator
from rollout.paged_decoder import PagedDecoder
from rollout.sampling import counter_exponential, row_keys, sample_next
from rollout.scheduler import ContinuousBatcher
from rollout.torch_backend import TorchGenerationBackend

EOS = 2


def paged(path, **kwargs) -> TorchGenerationBackend:
    """A paged backend with small blocks (prompts span several blocks and end mid-block) and few rows."""
    options = dict(decode="paged", block_size=4, max_num_seqs=3)
    options.update(kwargs)
    return TorchGenerationBackend(str(path), **options)


def assert_same_completions(a, b, atol=1e-5):
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 7])
def test_continuous_batching_equals_one_batch(tiny_ckpt, prompts, tokenizer, max_num_seqs):
    """A few rows at a time with refills (and packed prefills of what each refill admits) == all 15 rows in
    one batch, with stops making lengths differ."""
    one_batch = paged(tiny_ckpt, max_num_seqs=64, block_size=16)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, seed=5, stop_token_ids=tokenizer.convert_tokens_to_ids(["e", "a"]))
    expected = one_batch.generate(prompts, params)
    assert one_batch.last_batch_sizes[0] == 15 and all(e[2] == 0 for e in one_batch.last_events if e[0] == "admit")
    assert len({len(c.token_ids) for c in expected}) > 2  # rows finish at different steps
    continuous = paged(tiny_ckpt, max_num_seqs=max_num_seqs)
    assert_same_completions(continuous.generate(prompts, params), expected)
    assert max(continuous.last_batch_sizes) == max_num_seqs


def test_refill_order_keeps_the_batch_full(tiny_ckpt, prompts, tokenizer):
    backend = paged(tiny_ckpt, max_num_seqs=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=1, stop_token_ids=tokenizer.convert_tokens_to_ids(["e", "a"]))
    out = backend.generate(prompts, params)
    admits = {row: step for kind, row, step in backend.last_events if kind == "admit"}
    finishes = {row: step for kind, row, step in backend.last_events if kind == "finish"}
    assert [row for kind, row, _ in backend.last_events if kind == "admit"] == list(range(2 * len(prompts)))
    for step, size in enumerate(backend.last_batch_sizes):
        # A row decodes at step s if admitted by s and not finished before (a row whose first token, sampled
        # at admission, stops it never decodes).
        decoding = [r for r in admits if admits[r] <= step and (finishes[r] > step or (
            finishes[r] == step and len(out[r].token_ids) > 1))]
        assert size == len(decoding)
        if any(admits[r] > step for r in admits):
            assert size == 4, f"step {step}: batch not refilled while requests wait"
    assert [len(c.token_ids) for c in out] != [12] * len(out)


def test_bucket_padding_equals_exact_batches(tiny_ckpt, prompts):
    """Static-shape steps padded to bucket 8 (the CPU stand-in for graph buckets) == unpadded steps."""
    params = SamplingParams(n=3, temperature=0.8, top_k=30, max_new_tokens=16, seed=2)
    padded = paged(tiny_ckpt, max_num_seqs=7, batch_buckets=(8,))
    exact = paged(tiny_ckpt, max_num_seqs=7, batch_buckets=tuple(range(1, 8)))
    calls: list[int] = []
    hook = padded.model.model.embed_tokens.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    out = padded.generate(prompts, params)
    hook.remove()
    steps = padded.last_batch_sizes
    assert set(calls) >= {8} and min(steps) < 7  # decode steps ran at 8 rows with fewer real rows
    assert_same_completions(out, exact.generate(prompts, params))


def test_prefix_sharing_cache_layout(tiny_ckpt):
    """Samples share the prompt's full blocks (refcount n), copy its partial block; all blocks come back."""
    backend = paged(tiny_ckpt, max_num_seqs=8, block_size=4)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks + a partial one
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=0)
    backend.generate([prompt], params)  # sizes the cache
    cache = backend.decoder.cache
    assert cache.allocator.num_free == cache.num_blocks - 1  # free list full again after the call
    batcher = ContinuousBatcher(backend.decoder, [prompt], params, {EOS}, max_num_seqs=8, seed=0)
    batcher.refill()
    tables = [row.table for row in batcher.running]
    assert len(tables) == 3 and all(len(t) == 4 for t in tables)  # ceil((10 + 6 - 1) / 4) blocks each
    full = tables[0][:2]
    assert all(t[:2] == full for t in tables) and all(cache.allocator.refcount[b] == 3 for b in full)
    partial = [t[2] for t in tables]
    assert len(set(partial)) == 3  # copy on write: one private partial block per sample
    for b in partial:  # each copy holds the prompt's K/V of positions 8, 9 in every layer
        torch.testing.assert_close(cache.k[:, b, :2], cache.k[:, partial[0], :2], atol=0, rtol=0)
    private = {b for t in tables for b in t[2:]}
    assert all(cache.allocator.refcount[b] == 1 for b in private) and len(private) == 6
    used = len(set(full) | private)
    assert cache.allocator.num_free == cache.num_blocks - 1 - used  # the last sample took the prompt's partial block
    while batcher.running or batcher.waiting:
        batcher.decode_step()
    assert cache.allocator.num_free == cache.num_blocks - 1
    assert all(c == 0 for c in cache.allocator.refcount)


def test_allocator_and_cache_size_errors(tiny_ckpt, prompts):
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(3)
    assert blocks == [1, 2, 3] and alloc.num_free == 0
    with pytest.raises(RuntimeError, match="2 blocks requested, 0 free"):
        alloc.allocate(2)
    alloc.release(blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        alloc.release([1])
    with pytest.raises(ValueError, match=r"kv_cache_tokens=2 must be >= block_size \(4\)"):
        paged(tiny_ckpt, kv_cache_tokens=2)
    small = paged(tiny_ckpt, kv_cache_tokens=8)
    with pytest.raises(ValueError, match=r"kv_cache_tokens"):
        small.generate(prompts, SamplingParams(max_new_tokens=16))


def test_counter_sampling_draws_from_the_distribution():
    """Keyed exponential-race draws hit each token with its probability (20k independent rows)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    rows = 20000
    keys = row_keys(123, torch.arange(rows))
    noise = counter_exponential(keys, torch.zeros(rows, dtype=torch.int64), 4)
    tokens = (probs[None] / noise).argmax(-1)
    freq = torch.bincount(tokens, minlength=4).float() / rows
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    assert abs(float(noise.mean()) - 1.0) < 0.02  # Exp(1) has mean 1
    # Same (key, step) -> same draw whatever the batch; another step -> other draws.
    logits = torch.log(probs)[None].repeat(rows, 1)
    params = SamplingParams(temperature=1.0)
    a, _ = sample_next(logits, params, keys_B=keys, steps_B=torch.zeros(rows, dtype=torch.int64))
    b, _ = sample_next(logits[:7], params, keys_B=keys[:7], steps_B=torch.zeros(7, dtype=torch.int64))
    c, _ = sample_next(logits, params, keys_B=keys, steps_B=torch.ones(rows, dtype=torch.int64))
    assert torch.equal(a[:7], b) and not torch.equal(a, c)


def test_paged_refit_sleep_and_contract(tiny_ckpt, tiny_ckpt_other, prompts):
    refit, fresh = paged(tiny_ckpt), paged(tiny_ckpt_other)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=11)
    before = refit.generate(prompts, params)
    refit.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after = refit.generate(prompts, params)
    assert_same_completions(after, fresh.generate(prompts, params), atol=0)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    refit.sleep(level=1)
    assert refit.decoder.cache is None  # the KV cache is freed
    refit.wake()
    assert_same_completions(refit.generate(prompts, params), after, atol=0)
    refit.sleep(level=2)
    refit.wake()  # reloads tiny_ckpt from disk
    assert_same_completions(refit.generate(prompts, params), before, atol=0)
    check_generation_backend(refit, prompts, eos_token_id=EOS)


def test_paged_rejects_unsupported_models(model_cache):
    path = cached_tiny_checkpoint("mistral", seed=0, cache_dir=model_cache, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8.*set decode=dense"):
        TorchGenerationBackend(str(path), decode="paged")
    with pytest.raises(ValueError, match="sliding_window=8.*decode='dense'"):
        PagedDecoder(AutoModelForCausalLM.from_pretrained(path))  # usable alone
    with pytest.raises(ValueError, match="sliding_window=8.*set kw.decode=dense"):
        TorchGenerationBackend.check_model(str(path), {"decode": "paged"}, prefix="kw.")
    for device in ("cpu", "cuda"):  # auto: dense where paged cannot run the model (the device is not touched)
        TorchGenerationBackend.check_model(str(path), {"device": device})


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_paged_refuses_mixture_of_experts_and_auto_decodes_them_dense(model_cache, arch):
    """The MoE blocks take the dense path's 3-D hidden states: on the packed paged rows they crashed in the first
    generation (and decode=auto chose paged on every GPU run)."""
    path = str(cached_tiny_checkpoint(arch, seed=0, cache_dir=model_cache))
    with pytest.raises(ValueError, match="mixture-of-experts layers"):
        TorchGenerationBackend.check_model(path, {"decode": "paged"})
    with pytest.raises(ValueError, match="mixture-of-experts layers.*set decode=dense"):
        TorchGenerationBackend(path, decode="paged")
    TorchGenerationBackend.check_model(path, {"device": "cuda"})  # auto on CUDA: dense
    with pytest.raises(ValueError, match="decode='fast'.*'paged'"):
        TorchGenerationBackend(str(path), decode="fast")


def test_a_call_that_fails_midway_leaves_the_backend_usable(tiny_ckpt, monkeypatch):
    """A decode step that raised (an OOM) left its rows' KV blocks allocated: every later call, valid ones too,
    failed with 'the paged KV cache cannot hold one request'. The next call equals a fresh backend's."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    backend = TorchGenerationBackend(str(tiny_ckpt), decode="paged")
    expected = TorchGenerationBackend(str(tiny_ckpt), decode="paged").generate(prompts, params)

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(backend.decoder, "decode", fail)
        with pytest.raises(RuntimeError, match="injected"):
            backend.generate(prompts, params)
    assert backend.decoder.cache.allocator.num_free == backend.decoder.cache.num_blocks - 1
    assert_same_completions(backend.generate(prompts, params), expected, atol=0)


@pytest.mark.parametrize("model_type", ["granite", "glm4", "olmo"])
def test_paged_refuses_architectures_it_does_not_compute(tmp_path, model_type):
    """Llama's module names with more math in the layer (Granite's multipliers, GLM-4's post-norms, OLMo's clip_qkv):
    the paged path ran them as Llama, 1 to 2.7 nats off HF's logprobs, and decode=auto chose it on CUDA."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                                  pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"computes the decoder layers of \['llama', 'mistral', 'qwen2', 'qwen3'\]; "
                                         rf".*model_type '{model_type}'.*set decode=dense"):
        TorchGenerationBackend.check_model(str(tmp_path), {"decode": "paged"})
    TorchGenerationBackend.check_model(str(tmp_path), {"device": "cuda"})  # auto on CUDA: dense


def test_paged_rejects_length_dependent_rope(model_cache):
    """Dynamic NTK / LongRoPE frequencies come from the batch's longest position, read on the host each step."""
    path = cached_tiny_checkpoint("llama", seed=0, cache_dir=model_cache,
                                  rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type='dynamic'.*decode=dense"):
        TorchGenerationBackend(str(path), decode="paged")
    with pytest.raises(ValueError, match="rope_type='dynamic'.*decode=dense"):
        TorchGenerationBackend.check_model(str(path), {"decode": "paged"})


# ---------------------------------------------------------------------- GPU (skipped without CUDA)
def _cuda_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """Logprobs of `completion` under a fresh single-sequence forward of `model` on CUDA (float32 result)."""
    from rl_core.logprobs import target_logprobs

    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return target_logprobs(logits[:-1], ids[0, 1:], temperature)[len(prompt) - 1:].cpu()


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_cuda(tiny_ckpt, prompts, hf_ref):
    graphs = paged(tiny_ckpt, device="cuda", max_num_seqs=8)
    eager = paged(tiny_ckpt, device="cuda", max_num_seqs=8, cuda_graphs=False)
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=24, seed=3)
    out = graphs.generate(prompts, params)
    assert graphs.decoder.graph_captures > 0 and eager.decoder.graph_captures == 0
    assert_same_completions(out, eager.generate(prompts, params))
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    greedy = graphs.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
    assert [c.token_ids for c in greedy] == [hf_ref.greedy(hf, p, 16) for p in prompts]


@pytest.mark.gpu
def test_refit_does_not_recapture_and_sleep_frees_the_cache_on_cuda(tiny_ckpt, tiny_ckpt_other, prompts):
    refit, fresh = paged(tiny_ckpt, device="cuda"), paged(tiny_ckpt_other, device="cuda")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4)
    refit.generate(prompts, params)
    captures = refit.decoder.graph_captures
    refit.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after = refit.generate(prompts, params)
    assert refit.decoder.graph_captures == captures  # same shapes: the captured graphs read the new weights
    assert_same_completions(after, fresh.generate(prompts, params), atol=1e-6)
    torch.cuda.synchronize()
    before_sleep = torch.cuda.memory_allocated()
    refit.sleep(level=1)
    freed = before_sleep - torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in refit.model.parameters())
    assert next(refit.model.parameters()).device.type == "cpu" and freed >= weights
    refit.wake()
    assert_same_completions(refit.generate(prompts, params), after, atol=1e-6)


@pytest.mark.gpu
def test_bf16_paged_logprobs_match_a_fresh_bf16_forward_on_cuda(model_cache, prompts):
    """bf16 paged decode vs a fresh bf16 HF forward of the same tokens (what the trainer recomputes)."""
    path = cached_tiny_checkpoint("qwen2", seed=5, cache_dir=model_cache, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4)
    backend = paged(path, device="cuda", dtype="bfloat16", max_num_seqs=16, block_size=16)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    out = backend.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=48, seed=0))
    gen = [torch.tensor(c.logprobs) for c in out]
    prev = [_cuda_logprobs(hf, prompts[c.prompt_index], c.token_ids, 1.0) for c in out]
    gen_t, prev_t = torch.cat(gen), torch.cat(prev)
    seq_ids = torch.cat([torch.full((len(g),), i) for i, g in enumerate(gen)])
    _, metrics = importance_weights(prev_t, gen_t, torch.ones_like(gen_t), seq_ids)
    assert float(metrics["token_mult_prob_error"]) <= 1.02
    assert abs(float(metrics["gen_kl"])) <= 1e-3
