"""pack_bins: validity properties, exact agreement with naive O(n^2) first/best-fit references, MFFD
against the 71/60 bound with a brute-force optimum, input errors, and an O(n^2) regression guard."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import pack_bins

ALGOS = ["mffd", "ffd", "bfd", "concat"]
FAST = settings(max_examples=60, deadline=None)


@st.composite
def lengths_and_capacity(draw, max_n=60):
    capacity = draw(st.integers(1, 200))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=max_n))
    return lengths, capacity


def _naive_decreasing(lengths):
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def naive_ffd(lengths, capacity):
    return naive_ffd_of(_naive_decreasing(lengths), lengths, capacity)


def naive_bfd(lengths, capacity):
    bins, loads = [], []
    for i in _naive_decreasing(lengths):
        fits = [b for b in range(len(bins)) if loads[b] + lengths[i] <= capacity]
        if fits:
            b = min(fits, key=lambda b: (capacity - loads[b], b))  # least room left, lowest id on ties
            bins[b].append(i)
            loads[b] += lengths[i]
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def naive_mffd(lengths, capacity):
    """Johnson-Garey MFFD on plain lists, step by step from the paper's description."""
    order = _naive_decreasing(lengths)
    large = [i for i in order if lengths[i] > capacity / 2]
    rest = [i for i in order if lengths[i] <= capacity / 2]  # decreasing, ties by index
    bins = [[i] for i in large]
    room = [capacity - lengths[i] for i in large]

    def largest_fitting(limit, low, high):  # largest remaining with low < s <= high and s <= limit
        fits = [i for i in rest if low < lengths[i] <= high and lengths[i] <= limit]
        return fits[0] if fits else None  # rest is decreasing, lowest index first on ties

    has_medium = [False] * len(bins)
    for b in range(len(bins)):
        i = largest_fitting(room[b], capacity / 3, capacity / 2)
        if i is not None:
            bins[b].append(i), rest.remove(i)
            room[b] -= lengths[i]
            has_medium[b] = True
    for b in reversed(range(len(bins))):
        if has_medium[b]:
            continue
        small = [i for i in rest if 11 * capacity / 71 < lengths[i] <= capacity / 3]
        if len(small) < 2:
            break
        s1 = min(small, key=lambda i: (lengths[i], i))
        s2 = min((i for i in small if i != s1), key=lambda i: lengths[i])
        if lengths[s1] + lengths[s2] > room[b]:
            break
        bins[b].append(s1), rest.remove(s1)
        room[b] -= lengths[s1]
        i = largest_fitting(room[b], 11 * capacity / 71, capacity / 3)
        bins[b].append(i), rest.remove(i)
        room[b] -= lengths[i]
    for b in range(len(bins)):
        while (i := largest_fitting(room[b], 0, capacity)) is not None:
            bins[b].append(i), rest.remove(i)
            room[b] -= lengths[i]
    return bins + naive_ffd_of(rest, lengths, capacity)


def naive_ffd_of(order, lengths, capacity):
    """First fit in the given order, scanning every open bin."""
    bins, loads = [], []
    for i in order:
        for b in range(len(bins)):
            if loads[b] + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def brute_force_optimum(lengths, capacity):
    """Fewest bins, by trying every assignment of items to bin labels (n <= 7)."""
    n = len(lengths)
    for k in range(1, n + 1):
        for labels in itertools.product(range(k), repeat=n):
            loads = [0] * k
            for i, b in enumerate(labels):
                loads[b] += lengths[i]
            if max(loads) <= capacity:
                return k
    return n


@pytest.mark.parametrize("algorithm", ALGOS)
@FAST
@given(data=lengths_and_capacity())
def test_bins_are_a_partition_within_capacity(algorithm, data):
    lengths, capacity = data
    bins = pack_bins(lengths, capacity, algorithm)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(type(i) is int for b in bins for i in b)  # plain ints, not numpy scalars (JSON, Ray)
    assert max(sum(lengths[i] for i in b) for b in bins) <= capacity


@FAST
@given(data=lengths_and_capacity())
def test_ffd_matches_naive_first_fit(data):
    lengths, capacity = data
    assert pack_bins(lengths, capacity, "ffd") == naive_ffd(lengths, capacity)


@FAST
@given(data=lengths_and_capacity())
def test_bfd_matches_naive_best_fit(data):
    lengths, capacity = data
    assert pack_bins(lengths, capacity, "bfd") == naive_bfd(lengths, capacity)


@FAST
@given(data=lengths_and_capacity())
def test_concat_keeps_order_and_opens_bins_only_when_needed(data):
    lengths, capacity = data
    bins = pack_bins(lengths, capacity, "concat")
    assert [i for b in bins for i in b] == list(range(len(lengths)))
    for prev, nxt in zip(bins, bins[1:]):  # the next bin's first sequence did not fit in the previous bin
        assert sum(lengths[i] for i in prev) + lengths[nxt[0]] > capacity


@FAST
@given(data=lengths_and_capacity())
def test_mffd_matches_naive_mffd(data):
    lengths, capacity = data
    assert pack_bins(lengths, capacity, "mffd") == naive_mffd(lengths, capacity)


@settings(max_examples=40, deadline=None)
@given(data=lengths_and_capacity(max_n=7))
def test_mffd_within_johnson_garey_bound_of_optimum(data):
    lengths, capacity = data
    optimum = brute_force_optimum(lengths, capacity)
    assert len(pack_bins(lengths, capacity, "mffd")) <= 71 * optimum / 60 + 1


def test_mffd_pairs_medium_items_with_large_ones():
    # capacity 100: large 60, 55; medium 40, 35 -> (60, 40), (55, 35): optimal 2 bins
    assert pack_bins([35, 60, 40, 55], 100, "mffd") == [[1, 2], [3, 0]]


def test_mffd_places_smallest_then_largest_fitting_small_item():
    # capacity 100, large 51 leaves 49; small items (15.5 < s <= 33) are 30, 20, 18: step (3) puts the
    # smallest (18) in, then the largest that still fits (30); 20 is left for a new bin.
    bins = pack_bins([51, 30, 20, 18], 100, "mffd")
    assert bins == [[0, 3, 1], [2]]


@pytest.mark.parametrize(
    "lengths, capacity, match",
    [
        ([], 10, "empty"),
        ([3, 0, 2], 10, r"lengths\[1\] = 0"),
        ([3, -2], 10, r"lengths\[1\] = -2"),
        ([3, 4], 0, "capacity must be >= 1"),
        ([3, 4], -5, "capacity must be >= 1"),
        ([3, 12, 4], 10, "sequence 1 has length 12 > capacity=10"),
    ],
)
def test_bad_input_raises_value_error(lengths, capacity, match):
    with pytest.raises(ValueError, match=match):
        pack_bins(lengths, capacity)


def test_bad_types_and_algorithm():
    with pytest.raises(TypeError, match="capacity"):
        pack_bins([1, 2], 10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ints"):
        pack_bins([1.5, 2.0], 10)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="choose one of"):
        pack_bins([1, 2], 10, "first_fit")


@pytest.mark.parametrize("algorithm", ALGOS)
def test_100k_sequences_pack_fast(algorithm):
    # A regression guard against O(n^2) scans (those take minutes here); bench/ measures the real time.
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(800) - 0.5, 1.0, 100_000).round(), 1, 8192).astype(np.int64)
    start = time.perf_counter()
    bins = pack_bins(lengths, 8192, algorithm)
    assert time.perf_counter() - start < 5.0
    assert sum(len(b) for b in bins) == len(lengths)
