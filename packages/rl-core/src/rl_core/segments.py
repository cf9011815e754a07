"""Per-sequence reductions over flat per-token tensors, keyed by `seq_ids` (T,)."""

from __future__ import annotations

from torch import Tensor


def num_segments(seq_ids: Tensor) -> int:
    return int(seq_ids.max()) + 1 if seq_ids.numel() else 0


def segment_sum(values: Tensor, seq_ids: Tensor) -> Tensor:
    """(T,) -> (S,): sum of `values` per sequence."""
    out = values.new_zeros(num_segments(seq_ids))
    return out.index_add(0, seq_ids, values)


def segment_mean(values: Tensor, mask: Tensor, seq_ids: Tensor) -> Tensor:
    """(T,) -> (S,): masked mean per sequence; 0 for a sequence without valid tokens."""
    total = segment_sum(values * mask, seq_ids)
    count = segment_sum(mask, seq_ids)
    return total / count.clamp(min=1)
