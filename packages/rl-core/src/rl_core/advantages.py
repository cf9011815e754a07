"""Advantage estimators over groups of completions that share a prompt.

Choices, stated once:
- GRPO baseline is the group mean, or with `leave_one_out` the mean of the *other* members (RLOO).
- The std used by `normalize_std` is Bessel-corrected: over the group, or with `leave_one_out` over the
  other members. Division happens only where that std is > 0, so a group whose members all got the
  same reward keeps advantage 0 instead of blowing up by 1/eps.
- A group of one has no baseline: its advantage is 0.
- Dr.GRPO is `normalize_std=False`; RLOO is `leave_one_out=True, normalize_std=False`.
- REINFORCE++ subtracts the group mean (if groups are given) and then whitens over the whole batch.
All inputs are 1-D per-sample tensors (N,); outputs are (N,) in the rewards' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to 0..G-1."""
    _, index = torch.unique(group_ids, return_inverse=True)
    return index, int(index.max()) + 1 if index.numel() else 0


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
    clip: float | None = None,
) -> Tensor:
    """GRPO advantages (N,): reward minus group baseline, optionally over the group std, optionally clipped."""
    _check(rewards, group_ids)
    index, num_groups = _group_index(group_ids)
    r = rewards
    zeros = torch.zeros(num_groups, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, index, torch.ones_like(r))
    mean = (zeros.index_add(0, index, r) / count)[index]
    n = count[index]
    # Sum of squared deviations from the group mean, from deviations (no E[x^2]-E[x]^2 cancellation).
    ss = zeros.index_add(0, index, (r - mean) ** 2)[index]
    if leave_one_out:
        m = n - 1  # size of "the others"
        baseline = (n * mean - r) / m.clamp(min=1)
        # Squared deviations of the others from their own mean: shift SS to that mean, drop member i.
        others_ss = ss + n * (mean - baseline) ** 2 - (r - baseline) ** 2
        var = others_ss / (m - 1).clamp(min=1)
        std_defined = m >= 2
    else:
        baseline = mean
        var = ss / (n - 1).clamp(min=1)
        std_defined = n >= 2
    adv = r - baseline
    if normalize_std:
        std = var.clamp(min=0).sqrt()
        adv = torch.where(std_defined & (std > 0), adv / (std + eps), adv)
    adv = torch.where(n > 1, adv, torch.zeros_like(adv))
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: reward minus the mean of the other members of its group."""
    return grpo_advantages(rewards, group_ids, normalize_std=False, leave_one_out=True)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: optional group-mean baseline, then batch whitening (mean 0, std 1 over the batch)."""
    adv = rewards
    if group_ids is not None:
        adv = grpo_advantages(rewards, group_ids, normalize_std=False)
    if adv.numel() < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + eps)
