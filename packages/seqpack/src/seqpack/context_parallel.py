"""Context-parallel (CP) sharding of a packed row: megatron's load-balanced 2*CP-chunk layout.

Owns `cp_shard_indices`, `cp_shard` and `cp_gather`. Each padded sequence (and the row's tail padding, if
any) is cut into 2*cp_size equal chunks and rank r keeps chunks r and 2*cp_size-1-r: with causal attention
chunk j costs ~j, so every rank gets the same work (r + 2cp-1-r). The row layout itself is
`seqpack.layout`; pack with `pad_multiple` a multiple of 2*cp_size so the chunks are whole tokens.
cp_size=1 is the identity on any layout. The tail is its own segment here: a row handed to TE's THD attention
(which cuts every [cu_seqlens_padded[i], cu_seqlens_padded[i+1]) the same way) must describe it as one, or
have none; folding the tail into the last sequence's padding there splits that sequence differently.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from ._validate import check_positive_int
from .layout import PackedLayout

logger = logging.getLogger(__name__)

__all__ = ["cp_gather", "cp_shard", "cp_shard_indices"]


def _segments(layout: PackedLayout, cp_size: int) -> tuple[list[int], list[int]]:
    """Starts and lengths of the CP segments: every padded sequence, then the tail padding if non-empty."""
    starts, lens = layout.offsets, list(layout.padded_lengths)
    for i, n in enumerate(lens):
        if n % (2 * cp_size):
            raise ValueError(
                f"sequence {i} has padded length {n} (real {layout.lengths[i]}), not a multiple of "
                f"2*cp_size={2 * cp_size}: pack with pad_multiple a multiple of {2 * cp_size}"
            )
    tail = layout.tail_len
    if tail:
        if tail % (2 * cp_size):
            raise ValueError(
                f"the row's tail padding is {tail} tokens, not a multiple of 2*cp_size={2 * cp_size}: pack "
                f"with total_multiple a multiple of {2 * cp_size} (and pad_multiple one too)"
            )
        starts, lens = [*starts, layout.total_len - tail], [*lens, tail]
    return starts, lens


def _check_cp(cp_size: int, cp_rank: int | None = None) -> int:
    cp_size = check_positive_int(cp_size, "cp_size")
    if cp_rank is not None:
        if isinstance(cp_rank, bool) or not isinstance(cp_rank, numbers.Integral):
            raise TypeError(f"cp_rank must be an int, got {type(cp_rank).__name__}")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    return cp_size


def cp_shard_indices(layout: PackedLayout, cp_size: int, cp_rank: int) -> Tensor:
    """(T/cp,) long positions in the row that rank `cp_rank` holds, in the order it holds them.

    Per segment: chunk cp_rank then chunk 2*cp_size-1-cp_rank, segments in row order.
    """
    cp_size = _check_cp(cp_size, cp_rank)
    device = layout.position_ids.device
    if cp_size == 1:  # the whole row, in order: no 2-chunk split, so no even-length requirement either
        return torch.arange(layout.total_len, device=device)
    starts, lens = _segments(layout, cp_size)
    seg_start = torch.tensor(starts, dtype=torch.int64, device=device)
    chunk = torch.tensor(lens, dtype=torch.int64, device=device) // (2 * cp_size)  # (num_segments,)
    first = seg_start + cp_rank * chunk
    second = seg_start + (2 * cp_size - 1 - cp_rank) * chunk
    piece_start = torch.stack([first, second], dim=1).flatten()  # (2 * num_segments,)
    piece_len = chunk.repeat_interleave(2)
    piece_offset = torch.cumsum(piece_len, 0) - piece_len  # where each piece starts in the shard
    n = int(piece_len.sum())
    within = torch.arange(n, device=device) - torch.repeat_interleave(piece_offset, piece_len)
    return torch.repeat_interleave(piece_start, piece_len) + within


def cp_shard(row: Tensor, layout: PackedLayout, cp_size: int, cp_rank: int) -> Tensor:
    """(T, *rest) -> (T/cp, *rest): the part of a packed row that CP rank `cp_rank` holds."""
    if row.dim() == 0 or row.shape[0] != layout.total_len:
        raise ValueError(
            f"cp_shard: row has shape {tuple(row.shape)} but the layout's total_len is {layout.total_len}"
        )
    return row.index_select(0, cp_shard_indices(layout, cp_size, cp_rank).to(row.device))


def cp_gather(shards: Sequence[Tensor], layout: PackedLayout, cp_size: int) -> Tensor:
    """Inverse of `cp_shard`: the shards of ranks 0..cp_size-1 -> the full row (T, *rest). Differentiable."""
    cp_size = _check_cp(cp_size)
    if len(shards) != cp_size:
        raise ValueError(f"cp_gather got {len(shards)} shards, expected one per rank (cp_size={cp_size})")
    per_rank = layout.total_len // cp_size
    for r, shard in enumerate(shards):
        if shard.dim() == 0 or shard.shape[0] != per_rank:
            raise ValueError(
                f"cp_gather: shard of rank {r} has shape {tuple(shard.shape)}, expected {per_rank} tokens "
                f"(total_len {layout.total_len} / cp_size {cp_size})"
            )
    device = shards[0].device
    held = torch.cat([cp_shard_indices(layout, cp_size, r) for r in range(cp_size)]).to(device)
    inverse = torch.empty_like(held)
    inverse[held] = torch.arange(held.numel(), device=device)
    return torch.cat(list(shards)).index_select(0, inverse)
