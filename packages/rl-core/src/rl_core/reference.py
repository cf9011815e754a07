"""The reference policy as weights only: a frozen copy of the policy's parameters, swapped in for a pass.

Owns `FrozenWeights`, which engines use to implement `rl_core.interfaces.ReferencePolicy`. The copy has
exactly the policy parameters' layout (same shapes, dtypes, devices and, for DTensors, the same sharding:
each rank keeps only its shards), no gradients and no optimizer state, so a reference costs one copy of
the weights instead of a second engine with its own optimizer and process groups. For the reference pass
the two sets are exchanged in place, one tensor at a time (NeMo-RL's `use_reference_model` does the same
swap), so the engine's forward code, its FSDP/DDP buffers and its parameter objects are untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor


class FrozenWeights:
    """A copy of `params` taken now; `swapped_in()` makes the model compute with it for a block."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params = list(params)
        with torch.no_grad():
            # plain tensors holding this rank's local shards; requires_grad False: no grads ever
            self.saved = [local_tensor(p).detach().clone() for p in self.params]

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds for the copy (its local shards)."""
        return sum(t.numel() * t.element_size() for t in self.saved)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the parameters hold the frozen values; the trained values come back after."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    def to(self, device: torch.device | str) -> None:
        """Move the copy (host while a colocated generator uses the device memory, back for the pass)."""
        self.saved = [t.to(device) for t in self.saved]

    @torch.no_grad()
    def _exchange(self) -> None:
        # one tensor of scratch memory at a time; copy_ writes into the parameter's own storage, which is
        # what FSDP2 (its padded shard) and megatron (its contiguous DDP buffer) read from
        for param, saved in zip(self.params, self.saved):
            scratch = local_tensor(param).detach().clone()
            local_tensor(param).copy_(saved)
            saved.copy_(scratch)


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's local shard (plain tensors as they are): the copies never communicate."""
    return t.to_local() if hasattr(t, "to_local") else t
