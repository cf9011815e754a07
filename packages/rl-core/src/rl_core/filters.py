"""Sample filters applied between rewards and training.

- DAPO dynamic sampling: a group whose members all got the same reward has zero advantage everywhere
  and only dilutes the batch; `dynamic_sampling_keep` marks the groups to keep (the trainer refills).
- Overlong filtering: a completion cut off by the length limit has no meaningful final reward, so it
  gets no loss; `overlong_loss_mask` zeroes its loss mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def dynamic_sampling_keep(rewards: Tensor, group_ids: Tensor, *, tol: float = 0.0) -> Tensor:
    """(N,) bool: True for samples whose group's rewards are not all equal (max - min > tol)."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, index, rewards.double(), "amax"
    )
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, index, rewards.double(), "amin"
    )
    return (hi - lo > tol)[index]


def overlong_loss_mask(loss_mask: list[Tensor], truncated: list[bool]) -> list[Tensor]:
    """Per-sequence loss masks with every truncated sequence's mask set to zero."""
    if len(loss_mask) != len(truncated):
        raise ValueError(f"{len(loss_mask)} loss masks but {len(truncated)} truncated flags")
    return [torch.zeros_like(m) if cut else m for m, cut in zip(loss_mask, truncated)]
