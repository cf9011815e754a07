"""Advantage estimators over groups of completions that share a prompt.

Choices, stated once:
- GRPO baseline is the group mean, or with `leave_one_out` the mean of the *other* members (RLOO).
- The std used by `normalize_std` is Bessel-corrected: over the group, or with `leave_one_out` over the
  other members. Division (by std + eps, eps = 1e-6 as in NeMo-RL and verl) happens only where that std
  is > 0, so a group whose members all got the same reward keeps advantage 0 instead of blowing up by 1/eps.
- A group of one has no baseline: its advantage is 0.
- Dr.GRPO is `normalize_std=False`; RLOO is `leave_one_out=True, normalize_std=False`.
- `batch_normalize` whitens the result over the whole batch (mean 0, std 1), REINFORCE++ style;
  REINFORCE++ with a group baseline is `normalize_std=False, batch_normalize=True`.
- `clip` applies last.
All inputs are 1-D per-sample tensors (N,); outputs are (N,) in the rewards' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _dense_groups(group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """Lay N samples out as a (G, M) group-by-member grid: returns row (N,), col (N,), sizes (G,), G, M."""
    _, row = torch.unique(group_ids, return_inverse=True)
    num_groups = int(row.max()) + 1
    order = torch.argsort(row, stable=True)
    sizes = torch.bincount(row, minlength=num_groups)
    starts = torch.cumsum(sizes, 0) - sizes
    col = torch.empty_like(row)
    col[order] = torch.arange(row.numel(), device=row.device) - starts[row[order]]
    return row, col, sizes, num_groups, int(sizes.max())


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    batch_normalize: bool = False,
    eps: float = 1e-6,
    clip: float | None = None,
) -> Tensor:
    """GRPO advantages (N,): reward minus group baseline, optionally over the group std, optionally whitened
    over the batch, optionally clipped."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    row, col, sizes, num_groups, width = _dense_groups(group_ids)
    grid = rewards.new_zeros(num_groups, width).index_put((row, col), rewards)  # (G, M)
    present = torch.zeros(num_groups, width, dtype=torch.bool, device=rewards.device).index_put(
        (row, col), torch.ones_like(row, dtype=torch.bool)
    )
    # pool[g, i, j]: does member j enter member i's baseline? (all members, or all but i)
    pool = present[:, None, :].expand(num_groups, width, width)
    if leave_one_out:
        pool = pool & ~torch.eye(width, dtype=torch.bool, device=rewards.device)
    values = grid[:, None, :].expand_as(pool)  # (G, M, M)
    count = pool.sum(-1)  # (G, M)
    hi = torch.where(pool, values, torch.full_like(values, float("-inf"))).amax(-1)
    lo = torch.where(pool, values, torch.full_like(values, float("inf"))).amin(-1)
    # A constant pool has std exactly 0 and its exact value as mean: rounding must not turn it into
    # a tiny std that 1 / (std + eps) would blow up.
    constant = hi == lo
    mean = torch.where(constant, lo, (values * pool).sum(-1) / count.clamp(min=1))
    deviation = torch.where(pool, values - mean[..., None], torch.zeros_like(values))
    std = (deviation.square().sum(-1) / (count - 1).clamp(min=1)).sqrt()
    adv = grid - mean
    if normalize_std:
        adv = torch.where((count >= 2) & ~constant & (std > 0), adv / (std + eps), adv)
    adv = adv[row, col]
    adv = torch.where(sizes[row] > 1, adv, torch.zeros_like(adv))
    if batch_normalize:
        adv = batch_whiten(adv, eps)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: reward minus the mean of the other members of its group."""
    return grpo_advantages(rewards, group_ids, normalize_std=False, leave_one_out=True)


def batch_whiten(adv: Tensor, eps: float = 1e-6) -> Tensor:
    """Mean 0 and (Bessel) std 1 over the whole batch; a batch of one is only centred."""
    if adv.numel() < 2:
        return adv - adv.mean()
    return (adv - adv.mean()) / (adv.std() + eps)


def reinforce_pp_advantages(rewards: Tensor, group_ids: Tensor | None = None, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: optional group-mean baseline, then batch whitening (mean 0, std 1 over the batch)."""
    if group_ids is None:
        return batch_whiten(rewards, eps)
    return grpo_advantages(rewards, group_ids, normalize_std=False, batch_normalize=True, eps=eps)
