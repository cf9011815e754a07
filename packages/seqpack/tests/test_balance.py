"""balance_partitions: partitions are exact covers, equal_size counts, Karmarkar-Karp never worse than a
hand-written greedy reference, KK alone within its spread bound and optimal where greedy is not (k=3, brute
force), the k=2 differencing core against the classic number-differencing spread, and input errors."""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import balance_partitions, partition_spread
from seqpack.balance import _karmarkar_karp

FAST = settings(max_examples=80, deadline=None)
lengths_st = st.lists(st.integers(1, 1000), min_size=1, max_size=40)


def reference_greedy_spread(lengths, k):
    """Longest first, each to the currently lightest of k bins (LPT), written from the definition."""
    sums = [0] * k
    for n in sorted(lengths, reverse=True):
        sums[sums.index(min(sums))] += n
    return max(sums) - min(sums)


def sums(lengths, parts):
    return [sum(lengths[i] for i in p) for p in parts]


@pytest.mark.parametrize("method", ["kk", "greedy"])
@FAST
@given(lengths=lengths_st, k=st.integers(1, 9), equal_size=st.booleans())
def test_partitions_cover_every_sequence_once(method, lengths, k, equal_size):
    parts = balance_partitions(lengths, k, method=method, equal_size=equal_size)
    assert len(parts) == k
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(type(i) is int for p in parts for i in p)
    if equal_size:
        counts = [len(p) for p in parts]
        assert max(counts) - min(counts) <= 1


@FAST
@given(lengths=lengths_st, k=st.integers(1, 9))
def test_kk_spread_never_worse_than_greedy(lengths, k):
    kk = balance_partitions(lengths, k, method="kk")
    assert partition_spread(lengths, kk) <= reference_greedy_spread(lengths, k)


@FAST
@given(lengths=lengths_st, k=st.integers(1, 9))
def test_greedy_matches_reference_lpt(lengths, k):
    greedy = balance_partitions(lengths, k, method="greedy")
    assert partition_spread(lengths, greedy) == reference_greedy_spread(lengths, k)


@FAST
@given(lengths=lengths_st)
def test_two_way_differencing_matches_classic_number_differencing(lengths):
    # Karmarkar-Karp for k=2: replace the two largest numbers by their difference; the last number left is
    # the spread of the partition the method builds.
    heap = [-n for n in lengths]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = -heapq.heappop(heap), -heapq.heappop(heap)
        heapq.heappush(heap, -(a - b))
    parts = _karmarkar_karp(list(lengths), 2, equal_size=False)
    assert abs(sums(lengths, parts)[0] - sums(lengths, parts)[1]) == -heap[0]


def brute_force_spread(lengths, k):
    """The smallest spread of any assignment of the sequences to k partitions (small inputs only)."""
    best = None
    for assign in itertools.product(range(k), repeat=len(lengths)):
        totals = [0] * k
        for n, part in zip(lengths, assign):
            totals[part] += n
        best = min(best if best is not None else max(totals), max(totals) - min(totals))
    return best


@FAST
@given(lengths=lengths_st, k=st.integers(2, 9), equal_size=st.booleans())
def test_kk_alone_spreads_no_wider_than_the_longest_sequence(lengths, k, equal_size):
    # Karmarkar-Karp itself, not balance_partitions (which falls back to greedy): merging two partial
    # solutions heaviest-with-lightest never widens the larger of their spreads, and every seed solution
    # (one sequence, or k of them) spreads at most the longest sequence.
    parts = _karmarkar_karp(list(lengths), k, equal_size)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert partition_spread(lengths, parts) <= max(lengths)


@pytest.mark.parametrize("lengths,optimum", [([22, 11, 16, 18, 4, 12, 14], 1), ([18, 22, 13, 27, 23, 17, 9], 3)])
def test_three_way_kk_finds_the_optimum_greedy_misses(lengths, optimum):
    assert brute_force_spread(lengths, 3) == optimum
    assert reference_greedy_spread(lengths, 3) >= optimum + 3
    assert partition_spread(lengths, _karmarkar_karp(lengths, 3, equal_size=False)) == optimum


def test_kk_finds_the_perfect_split_greedy_misses():
    lengths = [8, 7, 6, 5, 4]  # greedy: {8,5,4}=17 vs {7,6}=13; differencing: spread 2
    assert reference_greedy_spread(lengths, 2) == 4
    assert partition_spread(lengths, balance_partitions(lengths, 2, method="kk")) == 2


def test_equal_size_with_more_partitions_than_sequences():
    parts = balance_partitions([5, 3], 4, equal_size=True)
    assert sorted(len(p) for p in parts) == [0, 0, 1, 1]


def test_bad_input():
    with pytest.raises(ValueError, match="empty"):
        balance_partitions([], 2)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        balance_partitions([4, 0], 2)
    with pytest.raises(ValueError, match="k must be >= 1"):
        balance_partitions([4, 2], 0)
    with pytest.raises(ValueError, match="choose one of"):
        balance_partitions([4, 2], 2, method="lpt")
