"""Packed-row layout: per-sequence tensors <-> one row, with cu_seqlens, position ids, seq ids and masks.

Owns `PackedLayout`, `pack`, `pack_like`, `unpack` and `block_causal_mask`. A row holds S sequences back to
back; sequence i occupies [cu_seqlens_padded[i], cu_seqlens_padded[i] + L_i) followed by its own padding up
to a multiple of `pad_multiple` (what CP/SP sharding needs), and the row ends with tail padding up to a
multiple of `total_multiple`. Choosing which sequences share a row is `seqpack.binpack`; cutting the row
for context parallelism is `seqpack.context_parallel`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validate import check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["PackedLayout", "block_causal_mask", "pack", "pack_like", "unpack"]


@dataclass(eq=False)  # tensor fields: == would be ambiguous, compare fields explicitly
class PackedLayout:
    """How S sequences sit in one packed row of length T."""

    lengths: list[int]  # real lengths L_i
    padded_lengths: list[int]  # L_i rounded up to pad_multiple
    cu_seqlens: Tensor  # (S+1,) int32, cumulative real lengths (what varlen kernels take for q/k)
    cu_seqlens_padded: Tensor  # (S+1,) int32, cumulative padded lengths: offsets of the sequences in the row
    total_len: int  # T = cu_seqlens_padded[-1] + tail padding up to total_multiple
    position_ids: Tensor  # (T,) long, restarts at 0 per sequence, counts on through its padding; tail 0..
    seq_ids: Tensor  # (T,) long, index of the sequence owning each slot, -1 on padding

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def offsets(self) -> list[int]:
        """Start of each sequence in the row (cu_seqlens_padded[:-1] as Python ints)."""
        return self.cu_seqlens_padded[:-1].tolist()

    @property
    def tail_len(self) -> int:
        """Padding after the last sequence's padded block."""
        return self.total_len - sum(self.padded_lengths)


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `value` (the one rounding rule of every layout)."""
    return -(-value // multiple) * multiple


def _check_tensors(tensors: Sequence[Tensor], name: str) -> None:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{name} must be a list of per-sequence tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise ValueError(f"{name} is empty: pass at least one sequence")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] == 0:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}: need (L, ...) with L >= 1 tokens")
        if t.shape[1:] != first.shape[1:] or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"{name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} but {name}[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all sequences of one field need the "
                "same trailing shape, dtype and device"
            )


def build_layout(
    lengths: Sequence[int],
    *,
    pad_multiple: int = 1,
    total_multiple: int = 1,
    device: torch.device | str = "cpu",
) -> PackedLayout:
    """The layout `pack` would build for sequences of these lengths (no tensor data needed)."""
    pad_multiple = check_positive_int(pad_multiple, "pad_multiple")
    total_multiple = check_positive_int(total_multiple, "total_multiple")
    lengths = [int(n) for n in lengths]
    if not lengths:
        raise ValueError("lengths is empty: pass at least one sequence")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs length >= 1")
    padded = [round_up(n, pad_multiple) for n in lengths]
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    cu_padded = torch.tensor([0, *padded], dtype=torch.int64).cumsum(0)
    used = int(cu_padded[-1])
    total = round_up(used, total_multiple)
    # Segment s (each padded sequence, then the tail) covers [seg_start[s], seg_start[s] + seg_len[s]).
    seg_len = torch.tensor([*padded, total - used], dtype=torch.int64)
    seg_start = torch.cat([cu_padded, cu_padded[-1:]])[: len(seg_len)]
    pos = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(seg_start, seg_len)
    seq_ids = torch.repeat_interleave(torch.arange(len(seg_len), dtype=torch.int64), seg_len)
    real_len = torch.tensor([*lengths, 0], dtype=torch.int64).repeat_interleave(seg_len)
    seq_ids = torch.where(pos < real_len, seq_ids, torch.full_like(seq_ids, -1))
    return PackedLayout(
        lengths=lengths,
        padded_lengths=padded,
        cu_seqlens=cu.to(torch.int32).to(device),
        cu_seqlens_padded=cu_padded.to(torch.int32).to(device),
        total_len=total,
        position_ids=pos.to(device),
        seq_ids=seq_ids.to(device),
    )


def _scatter_into_row(tensors: Sequence[Tensor], layout: PackedLayout, pad_value: float | int) -> Tensor:
    first = tensors[0]
    row = torch.full((layout.total_len, *first.shape[1:]), pad_value, dtype=first.dtype, device=first.device)
    for t, start in zip(tensors, layout.offsets):
        row[start : start + t.shape[0]] = t
    return row


def pack(
    tensors: Sequence[Tensor], *, pad_multiple: int = 1, total_multiple: int = 1, pad_value: float | int = 0
) -> tuple[Tensor, PackedLayout]:
    """Concatenate per-sequence tensors (L_i, *rest) into one row (T, *rest) and describe the layout.

    Each sequence is padded with `pad_value` to a multiple of `pad_multiple` (e.g. 2*CP*TP), and the row to
    a multiple of `total_multiple`. Pack further per-token fields with `pack_like(fields, layout)`.
    """
    _check_tensors(tensors, "tensors")
    layout = build_layout(
        [t.shape[0] for t in tensors],
        pad_multiple=pad_multiple,
        total_multiple=total_multiple,
        device=tensors[0].device,
    )
    return _scatter_into_row(tensors, layout, pad_value), layout


def pack_like(tensors: Sequence[Tensor], layout: PackedLayout, pad_value: float | int = 0) -> Tensor:
    """Pack another per-token field (labels, masks, advantages ...) into the same layout as `pack` made."""
    _check_tensors(tensors, "tensors")
    if len(tensors) != layout.num_seqs:
        raise ValueError(
            f"pack_like got {len(tensors)} tensors but the layout holds {layout.num_seqs} sequences"
        )
    for i, (t, n) in enumerate(zip(tensors, layout.lengths)):
        if t.shape[0] != n:
            raise ValueError(
                f"pack_like: tensors[{i}] has {t.shape[0]} tokens but sequence {i} of the layout has {n}; "
                "every field must have the same per-sequence lengths as the packed tokens"
            )
    return _scatter_into_row(tensors, layout, pad_value)


def unpack(row: Tensor, layout: PackedLayout) -> list[Tensor]:
    """Inverse of `pack`: (T, *rest) -> [(L_i, *rest)], real tokens only (views into `row`)."""
    if not isinstance(row, Tensor) or row.dim() == 0 or row.shape[0] != layout.total_len:
        shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
        raise ValueError(f"unpack: row has shape {shape} but the layout's total_len is {layout.total_len}")
    return [row[start : start + n] for start, n in zip(layout.offsets, layout.lengths)]


def block_causal_mask(layout: PackedLayout) -> Tensor:
    """(T, T) bool, True = query t may attend to key s: s <= t within the same sequence.

    A padding slot attends only to itself, so no softmax row is empty (an all-False row gives NaN in sdpa);
    its outputs are garbage that `unpack` drops. For kernels without varlen support, e.g. sdpa on CPU;
    pass it as `attn_mask` (bool) to sdpa. Eager HF attention adds the mask to the scores, so there convert
    it to a float mask first (0 / finfo.min).
    """
    seq = layout.seq_ids
    same = (seq[:, None] == seq[None, :]) & (seq[:, None] >= 0)
    causal = torch.ones(layout.total_len, layout.total_len, dtype=torch.bool, device=seq.device).tril_()
    return (same & causal) | torch.eye(layout.total_len, dtype=torch.bool, device=seq.device)
