"""plan_micro_batches / MicroBatchPlan.restore: budgets (cost recomputed from the definition), exact cover,
restore order, sort windows, min_micro_batches, the no-budget case, and input errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import MicroBatchPlan, plan_micro_batches

FAST = settings(max_examples=80, deadline=None)


def cost(lengths, mb, packing, round_to):
    """Definition: packed = sum of rounded lengths; padded = count x rounded max length."""
    rounded = [((lengths[i] + round_to - 1) // round_to) * round_to for i in mb]
    if not rounded:
        return 0
    return sum(rounded) if packing else len(rounded) * max(rounded)


@st.composite
def plan_case(draw):
    lengths = draw(st.lists(st.integers(1, 100), min_size=1, max_size=40))
    round_to = draw(st.sampled_from([1, 4, 16]))
    longest = ((max(lengths) + round_to - 1) // round_to) * round_to
    return dict(
        lengths=lengths,
        max_tokens=draw(st.one_of(st.none(), st.integers(longest, 4 * longest))),
        max_seqs=draw(st.one_of(st.none(), st.integers(1, 8))),
        packing=draw(st.booleans()),
        algorithm=draw(st.sampled_from(["mffd", "ffd", "bfd", "concat"])),
        round_to=round_to,
        min_micro_batches=draw(st.integers(1, 6)),
        sort_window=draw(st.one_of(st.none(), st.integers(1, 16))),
    )


@FAST
@given(case=plan_case())
def test_budgets_cover_and_windows(case):
    lengths = case["lengths"]
    plan = plan_micro_batches(**case)
    assert sorted(i for mb in plan.micro_batches for i in mb) == list(range(len(lengths)))
    assert all(type(i) is int for mb in plan.micro_batches for i in mb)
    assert len(plan.micro_batches) >= case["min_micro_batches"]
    for mb in plan.micro_batches:
        if case["max_tokens"] is not None:
            assert cost(lengths, mb, case["packing"], case["round_to"]) <= case["max_tokens"]
        if case["max_seqs"] is not None:
            assert len(mb) <= case["max_seqs"]
        if case["packing"] and case["sort_window"] is not None and case["max_tokens"] is not None:
            assert len({i // case["sort_window"] for i in mb}) <= 1  # bins never mix windows
    if not case["packing"] and (case["max_tokens"], case["max_seqs"]) != (None, None):
        # padded: micro-batches are consecutive runs of the window-sorted order
        window = case["sort_window"] or len(lengths)
        rounded = [-(-n // case["round_to"]) for n in lengths]
        expected = []
        for start in range(0, len(lengths), window):
            expected += sorted(
                range(start, min(start + window, len(lengths))), key=lambda i: (-rounded[i], i)
            )
        assert [i for mb in plan.micro_batches for i in mb] == expected
    if len(lengths) >= case["min_micro_batches"]:
        assert all(plan.micro_batches)  # empty micro-batches only when there are too few sequences


@FAST
@given(case=plan_case())
def test_restore_gives_input_order(case):
    plan = plan_micro_batches(**case)
    outputs = [[("out", i, case["lengths"][i]) for i in mb] for mb in plan.micro_batches]
    assert plan.restore(outputs) == [("out", i, n) for i, n in enumerate(case["lengths"])]


def test_no_budget_is_one_micro_batch_in_order():
    assert plan_micro_batches([5, 1, 7]).micro_batches == [[0, 1, 2]]
    assert plan_micro_batches([5, 1, 7], min_micro_batches=5).micro_batches[3:] == [[], []]


def test_padded_sorting_reduces_padding():
    lengths = [10, 100, 12, 98, 11, 97]
    plan = plan_micro_batches(lengths, max_tokens=300)
    assert sorted(sorted(mb) for mb in plan.micro_batches) == [[0, 2, 4], [1, 3, 5]]


def test_sort_window_one_keeps_input_order_and_spans_windows():
    # arrival order: [10, 100] costs 2 x 100 = 200; adding 12 would cost 300; [12, 98] costs 196
    plan = plan_micro_batches([10, 100, 12, 98], max_tokens=200, sort_window=1)
    assert plan.micro_batches == [[0, 1], [2, 3]]


def test_packing_fills_bins_to_the_budget():
    plan = plan_micro_batches([60, 40, 70, 30, 50, 50], max_tokens=100, packing=True)
    assert len(plan.micro_batches) == 3  # 300 tokens in 3 full bins of 100


def test_restore_rejects_misaligned_outputs():
    plan = MicroBatchPlan([[1], [0, 2]])
    with pytest.raises(ValueError, match="outputs for 1 micro-batches"):
        plan.restore([[1]])
    with pytest.raises(ValueError, match="micro-batch 1 holds 2 sequences but its output has 1"):
        plan.restore([["a"], ["b"]])
    with pytest.raises(ValueError, match="exactly once"):
        MicroBatchPlan([[0], [0]])


def test_bad_input():
    with pytest.raises(ValueError, match="empty"):
        plan_micro_batches([], max_tokens=10)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0"):
        plan_micro_batches([3, 0], max_tokens=10)
    with pytest.raises(ValueError, match=r"sequence 1 has length 9 \(12 after round_to=4\) > max_tokens=10"):
        plan_micro_batches([3, 9], max_tokens=10, round_to=4)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        plan_micro_batches([3], max_tokens=0)
    with pytest.raises(ValueError, match="min_micro_batches must be >= 1"):
        plan_micro_batches([3], min_micro_batches=0)
    for limits in (dict(max_tokens=10), dict(max_seqs=1), {}):  # without a token budget no bin is packed
        with pytest.raises(ValueError, match="algorithm='fdd' is not a bin-packing algorithm"):
            plan_micro_batches([3, 4], packing=True, algorithm="fdd", **limits)
