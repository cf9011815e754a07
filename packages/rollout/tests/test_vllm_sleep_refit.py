"""A refit while vLLM sleeps (the colocated GPU loop: sleep after generation, train, refit, wake) must reach the
weights the next generation uses. vLLM's sleep mode exists on GPUs only, so `vllm.LLM` is replaced here by a
model of its documented semantics; the real GPU check is still to be run (no vLLM on the GPU machines yet)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

ALL_TAGS = ("weights", "kv_cache")


class SleepModeLLM:
    """vLLM sleep mode in miniature: level 1 keeps a host copy of the weights, level 2 keeps none; wake_up
    restores the tagged pools (the weights from the host copy); touching memory that sleeps fails, as
    unmapped device memory would."""

    def __init__(self, **kwargs) -> None:
        self.weights, self.host, self.awake = {"w": 0.0}, None, set(ALL_TAGS)
        self.model_config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(tie_word_embeddings=False))

    def sleep(self, level: int) -> None:
        self.host = dict(self.weights) if level == 1 else None
        self.weights, self.awake = {"w": math.nan}, set()

    def wake_up(self, tags=None) -> None:
        for tag in tags or ALL_TAGS:
            if tag == "weights" and tag not in self.awake and self.host is not None:
                self.weights = dict(self.host)
            self.awake.add(tag)

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        if "weights" not in self.awake:
            raise RuntimeError("reload_weights into sleeping (unmapped) weight memory")
        self.weights.update({name: float(t) for name, t in kwargs["weights_iterator"]})

    def reset_prefix_cache(self) -> None:
        pass


@pytest.fixture
def backend(monkeypatch, tmp_path):
    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=SleepModeLLM))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    from rollout.vllm_backend import VLLMGenerationBackend

    return VLLMGenerationBackend(str(tmp_path), enable_sleep_mode=True, refit="tensors")


@pytest.mark.parametrize("level", [1, 2])
def test_refit_while_asleep_is_what_the_next_generation_sees(backend, level):
    backend.sleep(level=level)
    backend.update_weights([("w", torch.tensor(1.5))])
    backend.wake()
    assert backend.llm.weights == {"w": 1.5} and backend.llm.awake == set(ALL_TAGS)


def test_sleep_and_wake_without_refit_keep_the_weights(backend):
    backend.update_weights([("w", torch.tensor(2.0))])  # awake: loaded directly
    backend.sleep(level=1)
    backend.wake()
    assert backend.llm.weights == {"w": 2.0} and backend.llm.awake == set(ALL_TAGS)


def test_wake_before_any_sleep_leaves_vllm_alone(backend, monkeypatch):
    """The colocated loop's first generation wakes an engine that never slept (grpo_app.colocation): vLLM
    would log 'Executor is not sleeping' on every rank."""
    monkeypatch.setattr(backend.llm, "wake_up", lambda tags=None: pytest.fail("wake_up of an awake engine"))
    backend.wake()
    assert backend.llm.awake == set(ALL_TAGS)


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_sample_vllm_aborted_is_an_error_not_a_length_cut_off(backend, monkeypatch, reason):
    """vLLM's finish reasons besides stop and length mean the sample is no completion (it was reported as a
    length cut-off, and trained on)."""
    sample = types.SimpleNamespace(index=0, token_ids=[5], logprobs=[{5: types.SimpleNamespace(logprob=-1.0)}],
                                   finish_reason=reason, stop_reason=None)
    monkeypatch.setattr(backend._vllm, "SamplingParams", lambda **kw: kw, raising=False)
    monkeypatch.setattr(backend.llm, "generate", lambda *a, **k: [types.SimpleNamespace(outputs=[sample])],
                        raising=False)
    from rl_core.interfaces import SamplingParams

    with pytest.raises(RuntimeError, match=f"finish_reason='{reason}'"):
        backend.generate([[1, 2]], SamplingParams(max_new_tokens=4))
    sample.finish_reason = "length"
    assert backend.generate([[1, 2]], SamplingParams(max_new_tokens=4))[0].finish_reason == "length"


def test_unseeded_sampling_across_external_launcher_ranks_is_refused(monkeypatch, tmp_path):
    """With external_launcher each TP rank samples for itself: without a seed their tokens would differ."""
    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=SleepModeLLM))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    from rl_core.interfaces import SamplingParams
    from rollout.vllm_backend import VLLMGenerationBackend

    tp2 = VLLMGenerationBackend(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="needs SamplingParams.seed"):
        tp2.generate([[1, 2]], SamplingParams(max_new_tokens=4, temperature=1.0))
