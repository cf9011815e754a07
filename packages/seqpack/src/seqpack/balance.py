"""Balanced split of sequences over k partitions (DP ranks) by token count: Karmarkar-Karp and greedy.

Owns `balance_partitions`. The quality measure is the spread: max minus min of the partitions' token sums.
Does not pack within a partition (that is `seqpack.binpack`) nor cut micro-batches (`seqpack.microbatch`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

import numpy as np

from ._validate import as_lengths, check_positive_int

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "balance_partitions", "partition_spread"]

METHODS = ("kk", "greedy")


def balance_partitions(
    lengths: Sequence[int] | np.ndarray, k: int, method: str = "kk", equal_size: bool = False
) -> list[list[int]]:
    """Split sequence indices into `k` partitions with near-equal token sums; each partition sorted.

    method "kk": Karmarkar-Karp largest differencing generalised to k subsets (repeatedly merge the two
    partial solutions with the largest spread, pairing the heaviest subset of one with the lightest of the
    other); if the plain greedy split happens to have a smaller spread on this input, that one is returned,
    so "kk" is never worse than "greedy". method "greedy": longest first, each to the lightest partition.
    equal_size: partition sizes differ by at most one (equal when k divides the number of sequences).
    With more partitions than sequences some partitions are empty.
    """
    arr = as_lengths(lengths)
    k = check_positive_int(k, "k")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not a balancing method; choose one of {list(METHODS)}")
    lens = arr.tolist()
    greedy = _greedy(lens, k, equal_size)
    if method == "greedy":
        return greedy
    kk = _karmarkar_karp(lens, k, equal_size)
    if partition_spread(lens, greedy) < partition_spread(lens, kk):
        logger.debug("greedy beat Karmarkar-Karp on %d sequences, k=%d; using greedy", len(lens), k)
        return greedy
    return kk


def partition_spread(lengths: Sequence[int], partitions: Sequence[Sequence[int]]) -> int:
    """max - min of the partitions' token sums."""
    sums = [sum(lengths[i] for i in part) for part in partitions]
    return max(sums) - min(sums)


def _greedy(lens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    n = len(lens)
    base, extra = divmod(n, k)  # with equal_size: `extra` partitions hold base + 1, the others base
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, p) for p in range(k)]  # (token sum, partition id): lightest first, lower id on ties
    num_full = 0
    for idx in sorted(range(n), key=lambda i: (-lens[i], i)):
        while True:
            total, p = heapq.heappop(heap)
            count = len(parts[p])
            # A partition that can take no more is dropped for good: caps only ever tighten.
            if not equal_size or count < base or (count == base and num_full < extra):
                break
        parts[p].append(idx)
        num_full += equal_size and len(parts[p]) == base + 1
        heapq.heappush(heap, (total + lens[idx], p))
    return [sorted(part) for part in parts]


def _karmarkar_karp(lens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    # A partial solution is k subsets [sum, indices], sorted by sum descending; its key is its spread.
    order = sorted(range(len(lens)), key=lambda i: (lens[i], i))
    if equal_size:
        # Seed solutions hold k items, one per subset, so every merge keeps subset sizes equal; zero-length
        # dummies (-1) fill the first group up to a multiple of k and are dropped at the end.
        order = [-1] * (-len(order) % k) + order
        groups = [order[s : s + k] for s in range(0, len(order), k)]
    else:
        groups = [[i] for i in order]
    heap = []
    for seq, group in enumerate(groups):
        subsets = [[lens[i] if i >= 0 else 0, [i]] for i in group] + [[0, []] for _ in range(k - len(group))]
        subsets.sort(key=lambda s: -s[0])
        heap.append((-(subsets[0][0] - subsets[-1][0]), seq, subsets))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = []
        for (sum_a, items_a), (sum_b, items_b) in zip(a, reversed(b)):  # heaviest with lightest
            if len(items_a) < len(items_b):
                items_a, items_b = items_b, items_a
            items_a.extend(items_b)  # small into large: O(n log n) copying overall
            merged.append([sum_a + sum_b, items_a])
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1
    return [sorted(i for i in items if i >= 0) for _, items in heap[0][2]]
