"""plan_dp_micro_batches (the planner both engines call) and rl-core's micro_batch_limits: every DP rank runs
the same number of micro-batches, and a micro-batch never runs more tokens than its budget once laid out
the way the engines lay it out (checked by brute force: the padded width searched token by token, the packed
row built by seqpack.pack)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.config import PolicyConfig, micro_batch_limits, parse_config
from rl_core.testing.distributed import run_distributed
from seqpack import pack, plan_dp_micro_batches, plan_micro_batches

FAST = settings(max_examples=60, deadline=None)


def _policy(mode: str, max_tokens: int, length_round: int) -> PolicyConfig:
    sections = {"packed": {"sequence_packing": {"enabled": True, "train_mb_tokens": max_tokens}},
                "dynamic": {"dynamic_batching": {"enabled": True, "train_mb_tokens": max_tokens,
                                                 "sequence_length_round": length_round}}}
    return parse_config(PolicyConfig, {"model_name": "x", **sections[mode]}, "policy")


def _padded_width(longest: int, multiples: tuple[int, ...]) -> int:
    """Brute force: the first width >= longest that every multiple divides."""
    width = longest
    while any(width % m for m in multiples):
        width += 1
    return width


def _laid_out_tokens(lengths: list[int], mb: list[int], mode: str, seq_multiple: int, length_round: int) -> int:
    import torch

    if mode == "packed":  # one packed row, every sequence padded to the engine's multiple
        _, layout = pack([torch.zeros(lengths[i]) for i in mb], pad_multiple=seq_multiple)
        return layout.total_len
    # padded rows: as wide as the longest sequence, a multiple of the engine's multiple and of the quantum
    return len(mb) * _padded_width(max(lengths[i] for i in mb), (seq_multiple, length_round))


@FAST
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=24), mode=st.sampled_from(["packed", "dynamic"]),
       seq_multiple=st.sampled_from([1, 2, 3, 4]), length_round=st.sampled_from([1, 4, 16, 64]),
       slack=st.integers(0, 300))
def test_micro_batches_fit_their_budget_as_laid_out(lengths, mode, seq_multiple, length_round, slack) -> None:
    longest = _padded_width(max(lengths), (seq_multiple, length_round) if mode == "dynamic" else (seq_multiple,))
    policy = _policy(mode, longest + slack, length_round)
    limits = micro_batch_limits(policy, training=True, seq_multiple=seq_multiple)
    plan = plan_micro_batches(lengths, **limits)
    for mb in plan.micro_batches:
        assert _laid_out_tokens(lengths, mb, mode, seq_multiple, length_round) <= longest + slack


def test_max_of_the_multiples_would_undercount() -> None:
    """The old DTensor rule round_to=max(64, TP=3) prices a 64-token sequence at 64; laid out it is 192 wide."""
    limits = micro_batch_limits(_policy("dynamic", 128, 64), training=True, seq_multiple=3)
    assert limits["round_to"] == 192
    assert _padded_width(64, (3, 64)) == 192


def _plan_on_rank(rank: int, world_size: int, per_rank_lengths: list[list[int]], limits: dict) -> list[list[int]]:
    return plan_dp_micro_batches(per_rank_lengths[rank], **limits).micro_batches


@pytest.mark.distributed
@pytest.mark.parametrize("limits", [dict(max_seqs=2), dict(max_tokens=64, packing=True, round_to=4),
                                    dict(max_tokens=64, round_to=8)])
def test_every_dp_rank_runs_the_busiest_ranks_count(limits: dict) -> None:
    per_rank = [[30, 7, 12, 50, 3, 22, 9, 40], [5, 61]]
    alone = [plan_micro_batches(lengths, **limits).num_micro_batches for lengths in per_rank]
    assert alone[0] > alone[1]  # the case under test: rank 1 has fewer
    plans = run_distributed(_plan_on_rank, world_size=2, args=(per_rank, limits))
    for lengths, mbs in zip(per_rank, plans):
        assert len(mbs) == max(alone)
        assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
        for mb in mbs:  # the budget still holds after the re-plan (count or packed/padded tokens)
            assert len(mb) <= limits.get("max_seqs", len(lengths))
            rounded = [-(-lengths[i] // limits.get("round_to", 1)) * limits.get("round_to", 1) for i in mb]
            used = sum(rounded) if limits.get("packing") else len(rounded) * max(rounded, default=0)
            assert used <= limits.get("max_tokens", used)



def _plan_or_error(rank: int, world_size: int, per_rank_lengths: list[list[int]], limits: dict) -> tuple[str, float]:
    import time

    start = time.perf_counter()
    try:
        result = f"planned {plan_dp_micro_batches(per_rank_lengths[rank], **limits).micro_batches}"
    except Exception as exc:  # noqa: BLE001 - the error is the result under test
        result = f"{type(exc).__name__}: {exc}"
    waited = time.perf_counter() - start
    if rank == 0:
        time.sleep(3)  # the failing process lives on (a Ray actor outlives its method's exception)
    return result, waited


@pytest.mark.distributed
def test_a_rank_that_cannot_plan_stops_every_rank_instead_of_hanging() -> None:
    """Rank 0 holds a sequence over the budget. It used to raise before the count's all-reduce, leaving rank 1
    blocked in it for as long as rank 0's process lived (in a job: until the NCCL timeout); now both raise
    at once."""
    limits = dict(max_tokens=64, packing=True)
    (error0, _), (error1, waited1) = run_distributed(_plan_or_error, world_size=2,
                                                     args=([[10, 100], [10, 20]], limits), timeout=60)
    assert error0.startswith("ValueError: sequence 1 has length 100") and "max_tokens=64" in error0
    assert error1.startswith("RuntimeError: micro-batch planning failed on DP rank 0")
    assert waited1 < 3  # did not wait for rank 0's process to go away
