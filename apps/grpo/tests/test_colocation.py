"""The colocation phases on a simulated GPU: what each side holds on the device at every call of a run.

The fakes follow the real sides' semantics (engines' offload / onload, vLLM's sleep level 1 and a refit
that wakes the generator's weights alone, rollout.vllm_backend), and every call is checked against what
it needs: the policy whole on the device for training, its weights (and nothing else of it) at the refit,
the generators awake for generation; and the device never holds the policy's training state next to the
generators' weights.
"""

from __future__ import annotations

import pytest

from grpo_app.colocation import Colocation

WEIGHTS, TRAINING_STATE = 2, 6  # GiB per rank: bf16 weights; fp32 grads, main params and Adam moments
GEN_WEIGHTS, KV_CACHE = 2, 30


class SimulatedGPU:
    def __init__(self) -> None:
        self.policy = {"weights", "training_state"}  # as built
        self.generator = {"weights", "kv_cache"}  # vLLM starts awake
        self.calls: list[str] = []

    def used(self) -> int:
        return (WEIGHTS * ("weights" in self.policy) + TRAINING_STATE * ("training_state" in self.policy)
                + GEN_WEIGHTS * ("weights" in self.generator) + KV_CACHE * ("kv_cache" in self.generator))

    def policy_call(self, method: str, keep_weights: bool = False) -> None:
        self.calls.append(f"policy.{method}" + ("(keep_weights)" if keep_weights else ""))
        if method == "onload":
            self.policy = {"weights", "training_state"}
        else:
            self.policy &= {"weights"} if keep_weights else set()

    def generator_call(self, method: str) -> None:
        self.calls.append(f"generators.{method}")
        self.generator = {"weights", "kv_cache"} if method == "wake" else set()
        # the policy's training state never sits next to the generators' weights
        assert not ("training_state" in self.policy and self.generator), (self.calls, self.policy, self.generator)

    def send_weights(self) -> int:
        self.calls.append("send")
        assert self.policy == {"weights"}, f"the refit reads the weights only: {self.policy}"
        self.generator |= {"weights"}  # update_weights wakes the weights alone (vLLM tags=['weights'])
        self.refit_used = self.used()
        return 1

    def generate(self) -> None:
        assert self.policy == set() and self.generator == {"weights", "kv_cache"}, (self.policy, self.generator)

    def train(self) -> None:
        assert self.policy == {"weights", "training_state"} and not self.generator, (self.policy, self.generator)


def colocation(gpu: SimulatedGPU, colocated: bool = True) -> Colocation:
    return Colocation(colocated, policy=gpu.policy_call, generators=gpu.generator_call)


def test_a_run_moves_each_side_only_when_the_other_needs_the_device():
    gpu = SimulatedGPU()
    phases = colocation(gpu)
    train_used = []

    def generate() -> None:
        phases.to_generation()
        gpu.generate()

    def train() -> None:
        phases.to_training()
        gpu.train()
        train_used.append(gpu.used())

    generate()  # validation of step 0
    generate()  # the step's rollout (and a dynamic-sampling round after it): nothing moves
    generate()
    train()  # prev logprobs
    train()  # the step
    assert phases.refit(gpu.send_weights) == 1
    generate()  # validation of step 1
    train()  # a checkpoint
    generate()  # step 1's rollout
    assert gpu.calls == [
        "policy.offload", "generators.wake",
        "generators.sleep", "policy.onload",
        "policy.offload(keep_weights)", "send", "policy.offload", "generators.wake",
        "generators.sleep", "policy.onload",
        "policy.offload", "generators.wake",
    ]
    # the refit's device memory: two copies of the weights, not the training state besides
    assert gpu.refit_used == WEIGHTS + GEN_WEIGHTS < max(train_used)


def test_a_resume_loads_then_refits_from_the_started_state():
    gpu = SimulatedGPU()
    phases = colocation(gpu)
    phases.to_training()  # load_checkpoint
    gpu.train()
    phases.refit(gpu.send_weights)
    gpu.generate()
    assert gpu.calls == ["generators.sleep", "policy.onload", "policy.offload(keep_weights)", "send",
                         "policy.offload", "generators.wake"]


def test_a_refit_asked_during_generation_takes_the_weights_back_first():
    gpu = SimulatedGPU()
    phases = colocation(gpu)
    phases.to_generation()
    phases.refit(gpu.send_weights)
    gpu.generate()
    assert gpu.calls[2:4] == ["generators.sleep", "policy.onload"]


@pytest.mark.parametrize("step", ["to_training", "to_generation", "refit"])
def test_without_colocation_nothing_moves(step):
    gpu = SimulatedGPU()
    phases = colocation(gpu, colocated=False)
    getattr(phases, step)(*([lambda: 0] if step == "refit" else []))
    assert gpu.calls == []
