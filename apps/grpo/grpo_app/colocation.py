"""Who holds the device memory when the policy and the generators share GPUs (`generation.colocated`).

Two phases, switched only when the other side needs the memory:

- training (logprobs, training steps, checkpoints): the policy is resident, the generators sleep (no KV
  cache, their weights on the host);
- generation: the policy is on the host, the generators are awake.

The refit is the bridge, in NeMo-RL's order (`offload_before_refit` / `offload_after_refit`): first the
policy's grads and optimizer state go to the host and torch's cache of the step's activations is freed,
so only the policy's weights are on the device when the generators' weights wake next to them to load
the new ones; then the policy's weights follow and the generators' KV cache wakes. The peak of a refit is
two copies of the weights, not the training step's peak plus a copy.

Without colocation nothing moves: every call here only runs the refit.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any


class Phase(enum.Enum):
    STARTED = "started"  # both sides as built: policy resident, generators awake
    TRAINING = "training"
    GENERATION = "generation"


class Colocation:
    """The phase machine. `policy(method, **kwargs)` calls a method on every policy rank and waits;
    `generators(method)` the same on every generator (in the policy ranks themselves with
    `generation.in_policy_workers`: one actor runs both sides, in call order)."""

    def __init__(self, colocated: bool, policy: Callable[..., Any], generators: Callable[[str], Any]) -> None:
        self.colocated = colocated
        self._policy = policy
        self._generators = generators
        self.phase = Phase.STARTED

    def to_training(self) -> None:
        if self.colocated and self.phase is not Phase.TRAINING:
            self._generators("sleep")  # first: the policy's onload needs the memory the generators free
            self._policy("onload")
        self.phase = Phase.TRAINING

    def to_generation(self) -> None:
        if self.colocated and self.phase is not Phase.GENERATION:
            self._policy("offload")
            self._generators("wake")
        self.phase = Phase.GENERATION

    def refit(self, send: Callable[[], int]) -> int:
        """Run `send` (the policy's weights into the generators) with only the policy's weights on the
        device, then hand the devices to the generators; returns what `send` returns."""
        self.to_training()  # export_hf_weights reads the policy's weights on the device
        if self.colocated:
            self._policy("offload", keep_weights=True)
        sent = send()
        self.to_generation()
        return sent
