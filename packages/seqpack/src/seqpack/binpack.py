"""Bin packing of sequence lengths into bins of a token capacity: FFD, MFFD, BFD and concat.

Owns `pack_bins` and the four algorithms. Output is bins of sequence indices; turning a bin into a packed
tensor row is `seqpack.layout`, splitting a batch by budget is `seqpack.microbatch`.

All algorithms run in O(n log n): first fit uses a max segment tree over bin remainders (the first bin with
room is found by one descent from the root), best fit a sorted list of the distinct remainders, and MFFD
keeps the unplaced items grouped by length (at most `capacity` distinct values), so 100k sequences pack in
well under a second without Python-level O(n^2) scans.
"""

from __future__ import annotations

import heapq
import logging
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Sequence

import numpy as np

from ._validate import as_lengths, check_fit, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["ALGORITHMS", "pack_bins"]


def pack_bins(lengths: Sequence[int] | np.ndarray, capacity: int, algorithm: str = "mffd") -> list[list[int]]:
    """Pack sequences into bins whose total length is <= `capacity`; return bins of sequence indices.

    algorithm: "mffd" (Johnson-Garey modified first-fit-decreasing, the default), "ffd" (first-fit
    decreasing), "bfd" (best-fit decreasing) or "concat" (keeps the input order; a new bin starts when the
    next sequence does not fit). Ties between equal lengths go to the lower index, so results are
    deterministic.
    """
    capacity = check_positive_int(capacity, "capacity")
    arr = as_lengths(lengths)
    check_fit(arr, capacity)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"algorithm={algorithm!r} is not a bin-packing algorithm; choose one of {sorted(ALGORITHMS)}"
        )
    return ALGORITHMS[algorithm](arr, capacity)


def _decreasing_order(arr: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, equal lengths by increasing index."""
    return np.argsort(-arr, kind="stable")


def _max_bins(total: int, count: int, capacity: int) -> int:
    # Any first-fit packing has content(i) + content(j) > capacity for bins i < j (each item of bin j did
    # not fit into bin i), so bins < 2 * total / capacity + 2: the segment tree never needs more leaves.
    return max(1, min(count, 2 * total // capacity + 2))


def _runs(order: np.ndarray, arr: np.ndarray) -> list[tuple[int, int, int]]:
    """(length, start, end) of each run of equal lengths in `order` (which is sorted by decreasing length)."""
    if len(order) == 0:
        return []
    sorted_lens = arr[order]
    cuts = (np.flatnonzero(np.diff(sorted_lens)) + 1).tolist()
    starts, ends = [0, *cuts], [*cuts, len(order)]
    return [(int(sorted_lens[s]), s, e) for s, e in zip(starts, ends)]


def _first_fit(order: np.ndarray, arr: np.ndarray, capacity: int) -> list[list[int]]:
    """First fit for items in `order` (decreasing length): each goes to the first bin with room."""
    if len(order) == 0:
        return []
    max_bins = _max_bins(int(arr[order].sum()), len(order), capacity)
    size = 1 << (max_bins - 1).bit_length()
    # tree[1] is the root; leaves tree[size + b] hold bin b's remaining room (unopened bins: full capacity),
    # inner nodes the max of their children, so "first bin with room >= L" is one descent.
    tree = [capacity] * (2 * size)
    bins: list[list[int]] = []
    items = order.tolist()
    for need, pos, end in _runs(order, arr):
        while pos < end:
            if tree[1] < need:  # cannot happen given _max_bins; guards against a silent wrong packing
                raise RuntimeError(f"first-fit tree of {size} bins is full; this is a seqpack bug")
            node = 1
            while node < size:
                node <<= 1
                if tree[node] < need:
                    node += 1
            # Equal items that follow go to this same bin while it has room (bins before it had none).
            room = tree[node]
            take = min(end - pos, room // need)
            b = node - size
            if b == len(bins):
                bins.append(items[pos : pos + take])
            else:
                bins[b].extend(items[pos : pos + take])
            pos += take
            tree[node] = room - take * need
            node >>= 1
            while node:
                left, right = tree[2 * node], tree[2 * node + 1]
                best = left if left > right else right
                if tree[node] == best:
                    break  # ancestors unchanged: stop early, most updates touch one or two levels
                tree[node] = best
                node >>= 1
    return bins


def _ffd(arr: np.ndarray, capacity: int) -> list[list[int]]:
    return _first_fit(_decreasing_order(arr), arr, capacity)


def _bfd(arr: np.ndarray, capacity: int) -> list[list[int]]:
    """Best fit decreasing: each item goes to the bin with the least room that still fits it (lowest id on ties)."""
    lens = arr.tolist()
    rooms: list[int] = []  # sorted distinct remaining room of open bins (room > 0); at most `capacity` values
    bins_by_room: dict[int, list[int]] = {}  # room -> min-heap of bin ids
    bins: list[list[int]] = []
    for idx in _decreasing_order(arr).tolist():
        need = lens[idx]
        pos = bisect_left(rooms, need)
        if pos == len(rooms):
            b, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[pos]
            heap = bins_by_room[room]
            b = heapq.heappop(heap)
            if not heap:
                del bins_by_room[room]
                rooms.pop(pos)
        bins[b].append(idx)
        room -= need
        if room > 0:
            if room not in bins_by_room:
                bins_by_room[room] = []
                insort(rooms, room)
            heapq.heappush(bins_by_room[room], b)
    return bins


def _concat(arr: np.ndarray, capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for idx, length in enumerate(arr.tolist()):
        if used + length > capacity:
            bins.append(current)
            current, used = [], 0
        current.append(idx)
        used += length
    bins.append(current)
    return bins


class _LengthPool:
    """Unplaced items grouped by length: sorted distinct lengths, and a stack of indices per length."""

    def __init__(self, order: np.ndarray, arr: np.ndarray) -> None:
        """`order`: indices by decreasing length, ties by increasing index."""
        # Stacks are reversed runs, so pop() yields the lowest index of a length first.
        self.stacks = {length: order[s:e][::-1].tolist() for length, s, e in _runs(order, arr)}
        self.values = sorted(self.stacks)
        self.taken: list[int] = []

    def largest_at_most(self, limit: int, above: int = 0) -> int | None:
        """Largest remaining length in (above, limit], or None."""
        pos = bisect_right(self.values, limit) - 1
        if pos >= 0 and self.values[pos] > above:
            return self.values[pos]
        return None

    def two_smallest_in(self, above: int, limit: int) -> tuple[int, int] | None:
        """The two smallest remaining lengths in (above, limit] (may be equal), or None."""
        pos = bisect_right(self.values, above)
        if pos >= len(self.values) or self.values[pos] > limit:
            return None
        first = self.values[pos]
        if len(self.stacks[first]) >= 2:
            return first, first
        if pos + 1 < len(self.values) and self.values[pos + 1] <= limit:
            return first, self.values[pos + 1]
        return None

    def take(self, length: int) -> int:
        stack = self.stacks[length]
        idx = stack.pop()
        self.taken.append(idx)
        if not stack:
            del self.stacks[length]
            self.values.pop(bisect_left(self.values, length))
        return idx


def _mffd(arr: np.ndarray, capacity: int) -> list[list[int]]:
    """Johnson & Garey (1985) modified first-fit-decreasing, worst case 71/60 OPT + 1.

    Classes by size s = length / capacity: large s > 1/2, medium 1/3 < s <= 1/2, small 11/71 < s <= 1/3,
    tiny the rest. (1) each large item opens its own bin, largest first; (2) forward through the large
    bins, add the largest medium item that fits; (3) backward through the large bins without a medium item,
    while the two smallest small items fit together, add the smallest small item and then the largest small
    item that fits; (4) forward through the large bins, keep adding the largest remaining item that fits;
    (5) first-fit-decreasing for the rest, in new bins.
    """
    lens = arr.tolist()
    order = _decreasing_order(arr)
    # Integer class bounds: length l is large iff 2l > C, medium iff 3l > C, small iff 71l > 11C.
    half, third, small_lo = capacity // 2, capacity // 3, (11 * capacity) // 71
    num_large = int(np.count_nonzero(2 * arr > capacity))
    bins = [[idx] for idx in order[:num_large].tolist()]
    rooms = [capacity - lens[idx] for idx in order[:num_large].tolist()]
    if num_large == 0:
        return _first_fit(order, arr, capacity)  # steps (2)-(4) need large bins: plain FFD
    pool = _LengthPool(order[num_large:], arr)
    has_medium = [False] * num_large
    for b in range(num_large):  # (2)
        length = pool.largest_at_most(min(rooms[b], half), above=third)
        if length is not None:
            bins[b].append(pool.take(length))
            rooms[b] -= length
            has_medium[b] = True
    for b in reversed(range(num_large)):  # (3)
        if has_medium[b]:
            continue
        pair = pool.two_smallest_in(small_lo, third)
        if pair is None or pair[0] + pair[1] > rooms[b]:
            break  # rooms only shrink further back, so no later bin takes the pair either
        bins[b].append(pool.take(pair[0]))
        rooms[b] -= pair[0]
        length = pool.largest_at_most(min(rooms[b], third), above=small_lo)
        bins[b].append(pool.take(length))  # type: ignore[arg-type]  # pair[1] fits, so one exists
        rooms[b] -= length  # type: ignore[operator]
    for b in range(num_large):  # (4)
        while (length := pool.largest_at_most(rooms[b])) is not None:
            bins[b].append(pool.take(length))
            rooms[b] -= length
    rest = order[num_large:]
    if pool.taken:
        placed = np.zeros(len(arr), dtype=bool)
        placed[pool.taken] = True
        rest = rest[~placed[rest]]  # still by decreasing length, ties by index
    return bins + _first_fit(rest, arr, capacity)  # (5)


ALGORITHMS: dict[str, Callable[[np.ndarray, int], list[list[int]]]] = {
    "mffd": _mffd,
    "ffd": _ffd,
    "bfd": _bfd,
    "concat": _concat,
}
