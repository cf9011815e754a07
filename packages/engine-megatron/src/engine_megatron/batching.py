"""From a rank's `TokenBatch` to the micro-batches megatron's schedules consume, and back.

Owns: the micro-batch plan (seqpack's token-budget planner, the same count on every DP rank), the model
inputs of one micro-batch (padded rows with megatron's causal mask, or one packed row described by THD
`PackedSeqParams`: sequence boundaries, O(S), never a T x T mask; TE's attention or, without TE,
packed_attention.PackedDotProductAttention reads them), the context-parallel shard of a packed row
(seqpack's load-balanced layout), and reading per-sequence results back out of the rows. Does not run the
model or the loss.

Position convention: `targets[r, t]` is the token after position t of row r, so the model's logprob at
position t is log p(token t+1 | <= t); a sequence starting at `start` with length L reads positions
start .. start+L-2 and is shifted right by one (rl_core's alignment: 0 at t = 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import seqpack
from engine_megatron.config import ResolvedSettings
from rl_core.batch import TokenBatch, host_to_device
from rl_core.config import PolicyConfig, micro_batch_limits
from rl_core.logprobs import shift_align


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch plus what is needed to read results back per sequence."""

    batch: TokenBatch  # the sequences (a one-token dummy when `weight` is 0)
    tokens: Tensor  # (B, S) long; S is this rank's CP shard length
    position_ids: Tensor  # (B, S) long
    targets: Tensor  # (B, S) long, the next token of each position (see module docstring)
    spans: list[tuple[int, int, int]]  # (row, start, length) of each sequence, in full-row coordinates
    packed_seq_params: Any = None  # megatron PackedSeqParams (THD) of a packed row, None for padded rows
    layout: Any = None  # seqpack.PackedLayout of the packed row
    weight: float = 1.0  # 0 for the dummy micro-batch of a rank with fewer sequences
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.tokens.shape[0]), int(self.tokens.shape[1])


def plan(batch: TokenBatch, policy: PolicyConfig, settings: ResolvedSettings, *, training: bool,
         dp_group: Any = None, device: torch.device | str = "cpu") -> seqpack.MicroBatchPlan:
    """Micro-batches of this rank's sequences; every DP rank gets the same count (seqpack's DP planner)."""
    multiple = settings.pack_multiple if settings.packing else settings.seq_multiple
    limits = micro_batch_limits(policy, training=training, seq_multiple=multiple)
    return seqpack.plan_dp_micro_batches(batch.lengths, group=dp_group, device=device, **limits)


def build_micro_batches(batch: TokenBatch, mb_plan: seqpack.MicroBatchPlan, settings: ResolvedSettings,
                        *, uniform_shape: bool, cp_rank: int = 0, cp_size: int = 1) -> list[MicroBatch]:
    """Model inputs for every planned micro-batch (empty ones become zero-weight dummies)."""
    parts = []
    for indices in mb_plan.micro_batches:
        if indices:
            parts.append((batch.select(indices), 1.0))
        else:
            parts.append((batch.dummy(settings.seq_multiple), 0.0))
    if settings.packing:
        mbs = [_packed(b, w, settings) for b, w in parts]
    else:
        mbs = [_padded(b, w, settings) for b, w in parts]
    if uniform_shape:  # pipeline stages exchange fixed-shape activations: one shape per step
        rows = max(mb.shape[0] for mb in mbs)
        cols = max(mb.shape[1] for mb in mbs)
        mbs = [_pad_to(mb, rows, cols) for mb in mbs]
    if settings.packing:  # after _pad_to: the row's tail padding belongs to its last sequence
        for mb in mbs:
            mb.layout = _absorb_tail(mb.layout, mb.shape[1])
            mb.position_ids = mb.layout.position_ids[None].long()
            mb.packed_seq_params = _thd_params(mb.layout)
    if cp_size > 1:
        mbs = [_cp_shard(mb, cp_rank, cp_size) for mb in mbs]
    return mbs


def _padded(batch: TokenBatch, weight: float, settings: ResolvedSettings) -> MicroBatch:
    lengths = batch.lengths
    cols = seqpack.round_up(max(lengths), settings.seq_multiple)
    tokens = torch.zeros(len(lengths), cols, dtype=torch.long)  # (B, S)
    for row, ids in enumerate(batch.input_ids):
        tokens[row, : len(ids)] = ids
    positions = torch.arange(cols).expand(len(lengths), cols).contiguous()
    spans = [(row, 0, n) for row, n in enumerate(lengths)]
    # Padding sits after each sequence and megatron's causal mask hides it from the real tokens.
    return MicroBatch(batch=batch, tokens=tokens, position_ids=positions, targets=tokens.roll(-1, dims=1),
                      spans=spans, weight=weight)


def _packed(batch: TokenBatch, weight: float, settings: ResolvedSettings) -> MicroBatch:
    row, layout = seqpack.pack(list(batch.input_ids), pad_multiple=settings.pack_multiple,
                               total_multiple=max(settings.pack_multiple, settings.seq_multiple))
    starts = layout.cu_seqlens_padded[:-1].tolist()
    spans = [(0, int(s), n) for s, n in zip(starts, layout.lengths)]
    return MicroBatch(batch=batch, tokens=row[None].long(), position_ids=layout.position_ids[None].long(),
                      targets=row.roll(-1)[None].long(), spans=spans, layout=layout, weight=weight)


def _pad_to(mb: MicroBatch, rows: int, cols: int) -> MicroBatch:
    b, s = mb.shape
    if (b, s) == (rows, cols):
        return mb
    grow = lambda t: torch.nn.functional.pad(t, (0, cols - s, 0, rows - b))  # noqa: E731
    positions = grow(mb.position_ids)
    positions[:, s:] = torch.arange(s, cols)
    mb.tokens, mb.position_ids, mb.targets = grow(mb.tokens), positions, grow(mb.targets)
    return mb


def _absorb_tail(layout: seqpack.PackedLayout, total_len: int) -> seqpack.PackedLayout:
    """The layout of the row padded to `total_len`, every slot after the last sequence's block counted as
    that sequence's padding. TE's THD attention (and its CP split) cuts each [cu_seqlens_padded[i],
    cu_seqlens_padded[i+1]) alike; the CP shard and gather here read this same layout, so both agree on
    a pipeline-padded row (they did not when only the THD params saw the tail: shards of unequal shapes)."""
    end = int(layout.cu_seqlens_padded[-1])
    if end == total_len:
        return layout
    last = int(layout.cu_seqlens_padded[-2])
    padded = layout.cu_seqlens_padded.clone()
    padded[-1] = total_len
    # positions count on through the last sequence's padding, as seqpack lays out padding
    positions = torch.cat([layout.position_ids[:end], torch.arange(end - last, total_len - last)])
    seq_ids = torch.nn.functional.pad(layout.seq_ids[:end], (0, total_len - end), value=-1)
    return dataclasses.replace(layout, padded_lengths=[*layout.padded_lengths[:-1], total_len - last],
                               cu_seqlens_padded=padded, total_len=total_len, position_ids=positions,
                               seq_ids=seq_ids)


def _thd_params(layout: seqpack.PackedLayout) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = layout.cu_seqlens_padded.int()
    max_len = int((padded[1:] - padded[:-1]).max())
    cu_seqlens = layout.cu_seqlens.int()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)


def _cp_shard(mb: MicroBatch, cp_rank: int, cp_size: int) -> MicroBatch:
    """This CP rank's chunks (r and 2*CP-1-r of every sequence) of a packed row."""
    index = seqpack.cp_shard_indices(mb.layout, cp_size, cp_rank)
    mb.tokens, mb.position_ids, mb.targets = mb.tokens[:, index], mb.position_ids[:, index], mb.targets[:, index]
    mb.extra["cp"] = (cp_size, cp_rank)
    return mb


def gather_cp(values: Tensor, mb: MicroBatch, group: Any) -> Tensor:
    """(1, T/CP) per-position values of this CP rank -> (1, T) full row, differentiable."""
    from torch.distributed.nn.functional import all_gather

    cp_size, _ = mb.extra["cp"]
    shards = all_gather(values[0].contiguous(), group=group)
    return seqpack.cp_gather(list(shards), mb.layout, cp_size)[None]


def per_sequence(values: Tensor, mb: MicroBatch) -> list[Tensor]:
    """(B, S) next-token values -> one (L_i,) tensor per sequence, aligned (0 at position 0)."""
    return [shift_align(values[row, start: start + n - 1]) for row, start, n in mb.spans]


def to_device(mbs: Sequence[MicroBatch], device: torch.device) -> None:
    for mb in mbs:
        mb.tokens, mb.position_ids, mb.targets = (host_to_device(t, device) for t in (mb.tokens, mb.position_ids, mb.targets))
        params = mb.packed_seq_params
        if params is not None:  # the attention kernels take cu_seqlens on the device of q/k/v
            moved: dict[int, Tensor] = {}  # q and kv share their tensors: one copy each
            for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                tensor = getattr(params, name)
                if id(tensor) not in moved:
                    moved[id(tensor)] = host_to_device(tensor, device)
                setattr(params, name, moved[id(tensor)])
