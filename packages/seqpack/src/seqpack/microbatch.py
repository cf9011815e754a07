"""Token-budget micro-batching (dynamic batching), padded or packed, with the permutation back.

Owns `MicroBatchPlan`, `plan_micro_batches` and `plan_dp_micro_batches` (the same number of micro-batches
on every data-parallel rank, which both engines call). A micro-batch's cost is what the engine computes on:
packed, the sum of the sequences' lengths rounded up to `round_to`; padded, the number of sequences times
the longest one (rounded). Sequences are reordered by length only within windows of `sort_window`
consecutive sequences, and `MicroBatchPlan.restore` puts per-sequence outputs back in input order.
Packing and token budgets work together: with `packing=True` each micro-batch is one bin of `pack_bins`.
Building the packed tensors is `seqpack.layout`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ._validate import as_lengths, check_positive_int
from .balance import balance_partitions
from .binpack import ALGORITHMS, pack_bins
from .layout import round_up

logger = logging.getLogger(__name__)

__all__ = ["MicroBatchPlan", "micro_batch_cost", "plan_dp_micro_batches", "plan_micro_batches"]

T = TypeVar("T")


@dataclass
class MicroBatchPlan:
    """Indices into the input lengths, per micro-batch, in run order; may contain empty micro-batches."""

    micro_batches: list[list[int]]

    def __post_init__(self) -> None:
        flat = sorted(i for mb in self.micro_batches for i in mb)
        if flat != list(range(len(flat))):
            raise ValueError("MicroBatchPlan.micro_batches must hold every index 0..n-1 exactly once")

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def num_seqs(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    def restore(self, outputs: Sequence[Sequence[T]]) -> list[T]:
        """Per-micro-batch outputs (in plan order, aligned with `micro_batches`) -> list in input order."""
        if len(outputs) != len(self.micro_batches):
            raise ValueError(
                f"restore got outputs for {len(outputs)} micro-batches, the plan has {len(self.micro_batches)}"
            )
        result: list = [None] * self.num_seqs
        for m, (mb, out) in enumerate(zip(self.micro_batches, outputs)):
            if len(out) != len(mb):
                raise ValueError(
                    f"restore: micro-batch {m} holds {len(mb)} sequences but its output has {len(out)} items "
                    "(an empty micro-batch takes an empty output)"
                )
            for idx, value in zip(mb, out):
                result[idx] = value
        return result


def micro_batch_cost(
    lengths: Sequence[int], indices: Sequence[int], *, packing: bool, round_to: int = 1
) -> int:
    """Tokens the engine computes for one micro-batch: packed sum or padded len * max, lengths rounded up."""
    costs = [round_up(int(lengths[i]), round_to) for i in indices]
    if not costs:
        return 0
    return sum(costs) if packing else len(costs) * max(costs)


def plan_micro_batches(
    lengths: Sequence[int] | np.ndarray,
    *,
    max_tokens: int | None = None,
    max_seqs: int | None = None,
    packing: bool = False,
    algorithm: str = "mffd",
    round_to: int = 1,
    min_micro_batches: int = 1,
    sort_window: int | None = None,
) -> MicroBatchPlan:
    """Cut a batch into micro-batches of cost <= max_tokens and at most max_seqs sequences each.

    sort_window: sequences are reordered only within consecutive windows of this many sequences (None: one
    window over the whole batch). Padded: each window is sorted by decreasing length and the budget cut runs
    over the windows in turn, so a micro-batch may span a window boundary (sort_window=1 keeps the input
    order). Packed: each window is bin-packed on its own. min_micro_batches: split the costliest
    micro-batch until there are that many, or append empty ones when every micro-batch holds a single
    sequence (engines run a zero-weight dummy pass for those, so all DP ranks run the same number).
    """
    arr = as_lengths(lengths)
    round_to = check_positive_int(round_to, "round_to")
    min_micro_batches = check_positive_int(min_micro_batches, "min_micro_batches")
    max_tokens = None if max_tokens is None else check_positive_int(max_tokens, "max_tokens")
    max_seqs = None if max_seqs is None else check_positive_int(max_seqs, "max_seqs")
    window = len(arr) if sort_window is None else check_positive_int(sort_window, "sort_window")
    # Checked here, not only in pack_bins: without max_tokens no bin is packed and a typo went unnoticed.
    if packing and algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm={algorithm!r} is not a bin-packing algorithm; choose one of {sorted(ALGORITHMS)}"
        )
    costs = -(-arr // round_to) * round_to
    if max_tokens is not None:
        over = np.flatnonzero(costs > max_tokens)
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"sequence {i} has length {int(arr[i])} ({int(costs[i])} after round_to={round_to}) > "
                f"max_tokens={max_tokens}: raise max_tokens or truncate the sequence"
            )
    if max_tokens is None and max_seqs is None:
        micro_batches = [list(range(len(arr)))]
    elif packing:
        micro_batches = []
        for start in range(0, len(arr), window):
            idx = np.arange(start, min(start + window, len(arr)))
            micro_batches += _plan_packed(idx, costs, max_tokens, max_seqs, algorithm)
    else:
        starts = range(0, len(arr), window)
        order = [
            i for s in starts for i in _by_decreasing_cost(np.arange(s, min(s + window, len(arr))), costs)
        ]
        micro_batches = _plan_padded(order, costs, max_tokens, max_seqs)
    micro_batches = _ensure_min(micro_batches, min_micro_batches, costs, packing)
    logger.debug("planned %d micro-batches for %d sequences", len(micro_batches), len(arr))
    return MicroBatchPlan(micro_batches)


def plan_dp_micro_batches(
    lengths: Sequence[int] | np.ndarray, *, group: Any = None, device: torch.device | str = "cpu", **limits: Any
) -> MicroBatchPlan:
    """`plan_micro_batches(lengths, **limits)` with the same number of micro-batches on every rank of `group`.

    Every micro-batch runs collectives (FSDP all-gathers, DDP reductions, megatron's schedules), so a rank
    with fewer or shorter sequences must run as many as the busiest rank: the count is all-reduced (max) over
    `group` and a rank below it re-plans with `min_micro_batches` (its costliest micro-batches split, or
    empty ones appended, which the engine runs as zero-weight dummies). `limits` use one rule for
    `round_to`: the multiple every sequence's padded length is a multiple of in the engine's layout (for a
    padded layout with a length quantum as well: `math.lcm` of both), so a micro-batch's cost is never less
    than the tokens the engine runs. `device`: where the count is reduced (cuda for an NCCL group).
    Without an initialised process group (or with one rank) this is `plan_micro_batches`.
    A rank whose own plan fails (e.g. a sequence longer than `max_tokens`) still joins the count's all-reduce,
    flagging the failure, and then every rank raises: the failing rank its own error, the others a
    RuntimeError naming it.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return plan_micro_batches(lengths, **limits)
    # Raising before the collective would leave every other rank blocked in it until the process group's
    # timeout (10 min for NCCL, 30 for gloo) with the error in one rank's log only: the failure rides along
    # with the count instead.
    plan: MicroBatchPlan | None = None
    error: Exception | None = None
    try:
        plan = plan_micro_batches(lengths, **limits)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective
        error = exc
    rank = dist.get_rank(group)
    # [micro-batch count, 1 + rank of a failing rank (0: none failed)], both reduced with max
    state = torch.tensor([0 if plan is None else plan.num_micro_batches, 0 if error is None else rank + 1],
                         dtype=torch.int64, device=device)
    dist.all_reduce(state, op=dist.ReduceOp.MAX, group=group)
    most, failed = state.tolist()
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"micro-batch planning failed on DP rank {failed - 1} of the group (its error is in "
                           "that rank's log); every rank stops here instead of waiting in a collective")
    assert plan is not None
    if most == plan.num_micro_batches:
        return plan
    return plan_micro_batches(lengths, **{**limits, "min_micro_batches": most})


def _by_decreasing_cost(idx: np.ndarray, costs: np.ndarray) -> list[int]:
    return idx[np.argsort(-costs[idx], kind="stable")].tolist()


def _plan_padded(
    order: list[int], costs: np.ndarray, max_tokens: int | None, max_seqs: int | None
) -> list[list[int]]:
    """Cut `order` greedily into runs with len * longest <= max_tokens and len <= max_seqs."""
    # Sorting (within windows) is what keeps the padding small: neighbours have similar lengths.
    tokens = max_tokens if max_tokens is not None else float("inf")
    seqs = max_seqs if max_seqs is not None else len(order)
    out: list[list[int]] = []
    longest = 0
    for i in order:
        c = int(costs[i])
        if out and len(out[-1]) < seqs and (len(out[-1]) + 1) * max(longest, c) <= tokens:
            out[-1].append(i)
            longest = max(longest, c)
        else:
            out.append([i])
            longest = c
    return out


def _plan_packed(
    idx: np.ndarray, costs: np.ndarray, max_tokens: int | None, max_seqs: int | None, algorithm: str
) -> list[list[int]]:
    if max_tokens is None:  # only a sequence count: longest first, max_seqs per micro-batch
        order = _by_decreasing_cost(idx, costs)
        return [order[s : s + max_seqs] for s in range(0, len(order), max_seqs)]  # type: ignore[misc]
    bins = [[int(idx[j]) for j in b] for b in pack_bins(costs[idx], max_tokens, algorithm)]
    if max_seqs is None:
        return bins
    # A subset of a bin is still under the token budget, so cutting by count keeps both limits.
    return [b[s : s + max_seqs] for b in bins for s in range(0, len(b), max_seqs)]


def _ensure_min(
    micro_batches: list[list[int]], minimum: int, costs: np.ndarray, packing: bool
) -> list[list[int]]:
    """Split the costliest splittable micro-batch in two until there are `minimum`; pad with empty ones."""
    micro_batches = [list(mb) for mb in micro_batches]
    while len(micro_batches) < minimum:
        splittable = [m for m, mb in enumerate(micro_batches) if len(mb) >= 2]
        if not splittable:
            micro_batches += [[] for _ in range(minimum - len(micro_batches))]
            break
        m = max(splittable, key=lambda m: micro_batch_cost(costs, micro_batches[m], packing=packing))
        mb = micro_batches[m]
        if packing:  # two halves with near-equal tokens, each kept in the micro-batch's order
            parts = balance_partitions(costs[mb], 2, method="kk")
            halves = [[mb[j] for j in part] for part in parts]
        else:  # sorted by length already: contiguous halves keep the padding small
            halves = [mb[: len(mb) // 2], mb[len(mb) // 2 :]]
        micro_batches[m : m + 1] = halves
    return micro_batches
