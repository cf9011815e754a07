"""Batched (packed) prefill and sampling inside the paged decode step, against independent references:
one-prompt prefills, the HF model's own logits and KV cache, a pure-Python murmur hash, and each row's draw
rebuilt from a fresh HF forward of its sequence, that Python hash's Exp(1) noise and a float64 top-k / top-p
filter (conftest's `hf_ref.filter_bounds`)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_core.interfaces import SamplingParams
from rollout.sampling import (
    _fmix32,
    _uniform_bits_int32,
    _uniform_bits_int64,
    counter_exponential,
    int32_hash_wraps,
    sample_next,
)
from rollout.scheduler import ContinuousBatcher
from rollout.torch_backend import TorchGenerationBackend

EOS = 2
MASK = 0xFFFFFFFF


def paged(path, **kwargs) -> TorchGenerationBackend:
    options = dict(decode="paged", block_size=4, max_num_seqs=16)
    options.update(kwargs)
    return TorchGenerationBackend(str(path), **options)


def prefill_into_fresh_cache(backend, prompts, one_at_a_time: bool):
    """Prefill `prompts` into blocks 1, 2, ... of a fresh cache; returns logits (P, V), the tables, the cache."""
    decoder = backend.decoder
    decoder.release()
    decoder.reserve(num_blocks=64, max_rows=len(prompts), table_width=16)
    tables = [decoder.cache.allocator.allocate(decoder.cache.blocks_for(len(p))) for p in prompts]
    if one_at_a_time:
        logits = torch.cat([decoder.prefill([p], [t]) for p, t in zip(prompts, tables)])
    else:
        logits = decoder.prefill(prompts, tables)
    return logits, tables, decoder.cache


def cached_kv(cache, layer: int, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K / V (kv_heads, length, head_dim) of one sequence read back from its blocks."""
    k, v = cache.gather(layer, torch.tensor([table]))
    return k[0, :, :length], v[0, :, :length]


def test_batched_prefill_equals_one_prompt_prefills_and_hf(tiny_ckpt, prompts):
    backend = paged(tiny_ckpt)
    packed_logits, tables, cache = prefill_into_fresh_cache(backend, prompts, one_at_a_time=False)
    packed_kv = [[cached_kv(cache, i, t, len(p)) for i in range(2)] for p, t in zip(prompts, tables)]
    single_logits, single_tables, single_cache = prefill_into_fresh_cache(backend, prompts, one_at_a_time=True)
    assert single_tables == tables
    torch.testing.assert_close(packed_logits, single_logits, atol=1e-5, rtol=0)  # matmul blocking differs
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for p, table, kv in zip(prompts, tables, packed_kv):
        with torch.no_grad():
            out = hf(torch.tensor([p]), use_cache=True)
        torch.testing.assert_close(packed_logits[prompts.index(p)], out.logits[0, -1], atol=1e-5, rtol=0)
        for layer, (k, v) in enumerate(kv):
            single_k, single_v = cached_kv(single_cache, layer, table, len(p))
            torch.testing.assert_close(k, single_k, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, single_v, atol=1e-5, rtol=0)
            torch.testing.assert_close(k, out.past_key_values.layers[layer].keys[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(v, out.past_key_values.layers[layer].values[0], atol=1e-5, rtol=0)


def test_prefill_token_budget_splits_forwards_and_changes_nothing(tiny_ckpt, prompts, tokenizer):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=12, seed=7,
                            stop_token_ids=tokenizer.convert_tokens_to_ids(["e"]))
    one_forward = paged(tiny_ckpt)
    expected = one_forward.generate(prompts, params)
    lengths = [len(p) for p in prompts]
    assert one_forward.last_prefill_sizes == [sum(lengths)]  # every prompt admitted at once: one forward
    budget = 30
    budgeted = paged(tiny_ckpt, max_prefill_tokens=budget)
    out = budgeted.generate(prompts, params)
    sizes = budgeted.last_prefill_sizes
    assert sum(sizes) == sum(lengths) and len(sizes) > 1
    assert all(s <= budget for s in sizes) and max(lengths) < budget
    assert [c.token_ids for c in out] == [c.token_ids for c in expected]
    torch.testing.assert_close(torch.tensor([x for c in out for x in c.logprobs]),
                               torch.tensor([x for c in expected for x in c.logprobs]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="max_prefill_tokens=0"):
        paged(tiny_ckpt, max_prefill_tokens=0)


def _python_fmix(h: int) -> int:
    """murmur3's 32-bit finaliser in Python integers (no tensor arithmetic)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK
    return h ^ (h >> 16)


def _python_unfmix(h: int) -> int:
    """The inverse of `_python_fmix` (xorshifts undone by repeated xor, multiplies by modular inverses)."""
    def unshift(h: int, s: int) -> int:
        x = h
        for _ in range(32 // s):
            x = h ^ (x >> s)
        return x

    h = unshift(h, 16)
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & MASK
    h = unshift(h, 13)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & MASK
    return unshift(h, 16)


def _python_uniform_bits(row_step: int, token: int) -> int:
    """The keyed hash of one (row, step) x token in Python integers (no tensor arithmetic)."""
    return _python_fmix(row_step ^ ((token * 0x85157AF5) & MASK)) >> 8


def _python_row_step(seed: int, request: int, step: int) -> int:
    """The hash of (row key, step): the row key of global row `request` under a request seed, as specified
    in rollout.sampling (row_keys, counter_exponential), in Python integers."""
    key = _python_fmix((_python_fmix(seed & MASK) + request * 0x9E3779B1) & MASK)
    return _python_fmix((key + step * 0x632BE5AB) & MASK)


def _python_exponential(row_step: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise (V,) float64 of one (row, step): -log u, u = (24 hash bits + 0.5) / 2**24 in (0, 1)."""
    return torch.tensor([-math.log((_python_uniform_bits(row_step, t) + 0.5) / (1 << 24)) for t in range(vocab)],
                        dtype=torch.float64)


def test_int32_noise_is_bit_equal_to_the_int64_hash_and_python():
    """The wrapping-int32 hash (the fast path) == the int64 hash (the fallback) == Python, Qwen-sized vocab."""
    vocab = 151936
    keys = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 12345, 0xDEADBEEF, 0x9E3779B1])
    steps = torch.tensor([0, 3, 255, 1, 4095, 7, 100, 2])
    row_step = _fmix32((keys + steps * 0x632BE5AB) & MASK)
    fast, exact = _uniform_bits_int32(row_step, vocab), _uniform_bits_int64(row_step, vocab)
    assert fast.dtype == torch.int32 and torch.equal(fast.long(), exact)
    rng = random.Random(0)
    for _ in range(3000):
        r, t = rng.randrange(len(keys)), rng.choice([0, 1, vocab - 1, rng.randrange(vocab)])
        assert int(fast[r, t]) == _python_uniform_bits(int(row_step[r]), t)
    assert int32_hash_wraps(torch.device("cpu"))


def test_noise_of_the_top_hash_value_is_positive_and_cannot_break_the_filter():
    """bits = 2**24 - 1 gives u = (2**24 - 0.5) / 2**24, which float32 rounds to 1: E = -log u must stay > 0,
    else that token wins the race whatever its probability, and a filtered-out token gets -inf + inf = NaN,
    which argmax picks (a top-k/top-p violation at ~V / 2**24 of draws: ~1% of tokens with Qwen's vocab)."""
    vocab, token, seed, request = 128, 100, 11, 0
    key = _python_fmix((_python_fmix(seed) + request * 0x9E3779B1) & MASK)
    # The step whose row hash gives `token` the top 24-bit value: invert (row step) ^ token -> fmix -> >> 8.
    row_step = _python_unfmix(0xFFFFFF00) ^ ((token * 0x85157AF5) & MASK)
    step = ((_python_unfmix(row_step) - key) * pow(0x632BE5AB, -1, 1 << 32)) & MASK
    assert _python_uniform_bits(_python_row_step(seed, request, step), token) == 0xFFFFFF
    keys, steps = torch.tensor([key]), torch.tensor([step])
    noise = counter_exponential(keys, steps, vocab)
    torch.testing.assert_close(noise[0].double(), _python_exponential(row_step, vocab), rtol=1e-5, atol=0)
    logits = torch.linspace(5.0, -30.0, vocab)[None]  # the token is ~e-22 below the top
    for top_k, top_p in [(3, 1.0), (0, 0.5), (0, 1.0)]:
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        tokens, _ = sample_next(logits, params, keys_B=keys, steps_B=steps)
        assert int(tokens) != token and int(tokens) < 3  # the race's winner: the top tokens, not the hashed one


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=20, top_p=0.9), dict(temperature=0.7, top_k=3),
                                      dict(temperature=1.0, top_p=0.5), dict(temperature=1.0),
                                      dict(temperature=0.0)], ids=["top-k-top-p", "top-k", "top-p", "plain", "greedy"])
def test_decode_step_samples_like_an_hf_forward_sampled_eagerly(tiny_ckpt, prompts, sampling, hf_ref):
    """Three decode steps of 5 rows padded to bucket 8: each row's token is the exponential race over a fresh
    HF forward of that row's sequence (float64 logits / T, float64 top-k / top-p), with the Exp(1) noise of
    the Python hash at the row's (seed, row, step), and its logprob the float64 log_softmax(logits / T) over
    the tokens top-k / top-p keep."""
    backend = paged(tiny_ckpt, batch_buckets=(8,))
    backend.generate(prompts, SamplingParams(max_new_tokens=8))  # sizes the cache
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    params = SamplingParams(max_new_tokens=8, **sampling)
    temperature = params.temperature or 1.0  # greedy reports logprobs at T = 1
    seed = 3
    batcher = ContinuousBatcher(backend.decoder, prompts, params, set(), max_num_seqs=5, seed=seed)
    batcher.refill()
    exact = 0
    for _ in range(3):
        rows = list(batcher.running)
        sequences = [prompts[r.request] + r.tokens for r in rows]
        batcher.decode_step()
        assert batcher.batch_sizes[-1] == 5
        for row, sequence in zip(rows, sequences):
            with torch.no_grad():
                x = hf(torch.tensor([sequence])).logits[0, -1].double() / temperature
            token = row.tokens[-1]
            kept = (hf_ref.filter_bounds(x, 1.0, params.top_k, params.top_p)[1] if params.temperature
                    else torch.ones_like(x, dtype=torch.bool))
            drawn_from = torch.log_softmax(torch.where(kept, x, float("-inf")), -1)  # the truncated distribution
            torch.testing.assert_close(row.logprobs[-1], float(drawn_from[token]), atol=1e-5, rtol=0)
            if params.temperature == 0.0:
                race, must = x, torch.ones_like(x, dtype=torch.bool)
                may = must
            else:
                must, may, _ = hf_ref.filter_bounds(x, 1.0, params.top_k, params.top_p, tol=1e-4)
                step = len(sequence) - len(prompts[row.request])
                race = x - _python_exponential(_python_row_step(seed, row.request, step), len(x)).log()
            # The draw is argmax(log p - log E) over the filtered tokens: it beats every token surely kept.
            best = torch.where(must, race, float("-inf")).max()
            assert may[token] and race[token] >= best - 1e-4, f"row {row.request}: token {token}"
            # and is that winner unless a token on the filter's float boundary, or one within float error, competes
            runner_up = torch.where(may & (race < best), race, float("-inf")).max()
            if best - runner_up > 1e-4 and int((may & (race >= best)).sum()) == 1:
                assert race[token] == best, f"row {row.request}: token {token} is not the race's winner"
                exact += 1
    assert exact >= 12  # of the 15 draws


# ---------------------------------------------------------------------- GPU (skipped without CUDA)
@pytest.mark.gpu
def test_keyed_noise_on_cuda_equals_cpu():
    """The in-graph hash on CUDA is bit-equal to the CPU's, its Exp(1) noise equal up to `log`'s last bits
    (so the CPU-tested draws hold on the GPU)."""
    from rollout.sampling import counter_exponential, row_keys

    assert int32_hash_wraps(torch.device("cuda", torch.cuda.current_device()))
    keys, steps = row_keys(9, torch.arange(64)), torch.arange(64) * 37
    row_step = _fmix32((keys + steps * 0x632BE5AB) & MASK)
    assert torch.equal(_uniform_bits_int32(row_step.cuda(), 151936).cpu(), _uniform_bits_int32(row_step, 151936))
    cpu = counter_exponential(keys, steps, 151936)
    cuda = counter_exponential(keys.cuda(), steps.cuda(), 151936)
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-6, atol=1e-9)


@pytest.mark.gpu
def test_graph_replay_with_sampling_inside_equals_eager_on_cuda(tiny_ckpt, prompts):
    """Captured steps (sampling inside, one graph per sampling setting) == the same steps run eagerly."""
    graphs = paged(tiny_ckpt, device="cuda", max_num_seqs=8)
    eager = paged(tiny_ckpt, device="cuda", max_num_seqs=8, cuda_graphs=False)
    settings = [SamplingParams(n=4, temperature=0.7, top_k=10, top_p=0.8, max_new_tokens=20, seed=1),
                SamplingParams(n=4, temperature=1.0, max_new_tokens=20, seed=1)]
    for params in settings:
        out, ref = graphs.generate(prompts, params), eager.generate(prompts, params)
        assert [c.token_ids for c in out] == [c.token_ids for c in ref]
        torch.testing.assert_close(torch.tensor([x for c in out for x in c.logprobs]),
                                   torch.tensor([x for c in ref for x in c.logprobs]), atol=1e-5, rtol=0)
    captured = {key[2] for key in graphs.decoder._graphs}
    assert captured == {(0.7, 10, 0.8), (1.0, 0, 1.0)}


@pytest.mark.gpu
def test_bf16_packed_prefill_equals_one_prompt_prefills_on_cuda(model_cache, prompts, monkeypatch):
    """bf16 on CUDA: the packed prefill (one varlen kernel call) == one causal sdpa prefill per prompt (the
    varlen kernel switched off for the reference, else both sides would run it), to bf16 rounding."""
    from rl_core.testing.tiny_models import cached_tiny_checkpoint
    from seqpack import attention

    path = cached_tiny_checkpoint("qwen2", seed=5, cache_dir=model_cache, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4)
    backend = paged(path, device="cuda", dtype="bfloat16", block_size=16)
    packed, _, _ = prefill_into_fresh_cache(backend, prompts, one_at_a_time=False)
    monkeypatch.setattr(attention, "uses_varlen", lambda query, dropout=0.0: False)
    single, _, _ = prefill_into_fresh_cache(backend, prompts, one_at_a_time=True)
    torch.testing.assert_close(packed.float(), single.float(), atol=2e-2, rtol=2e-2)
