"""CP sharding: indices against a hand-written per-token reference of megatron's rule (rank r holds chunks
r and 2cp-1-r of every padded sequence), shard-then-gather identity, equal causal work per rank, gradient
flow through the gather, and errors for layouts not padded to 2*cp."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import cp_gather, cp_shard, cp_shard_indices, pack

FAST = settings(max_examples=50, deadline=None)


@st.composite
def cp_case(draw):
    cp = draw(st.integers(1, 4))
    pad_multiple = 2 * cp * draw(st.integers(1, 3))
    total_multiple = 2 * cp * draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=5))
    seqs = [torch.randn(n, 3, dtype=torch.float64) for n in lengths]
    row, layout = pack(seqs, pad_multiple=pad_multiple, total_multiple=total_multiple)
    return row, layout, cp


def reference_indices(layout, cp, rank):
    """Megatron's load-balanced split, token by token: per segment, chunk `rank` then chunk 2cp-1-rank."""
    segments = list(zip(layout.cu_seqlens_padded[:-1].tolist(), layout.padded_lengths))
    used = sum(layout.padded_lengths)
    if layout.total_len > used:
        segments.append((used, layout.total_len - used))  # tail padding is split the same way
    out = []
    for start, length in segments:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out += [start + c * chunk + j for j in range(chunk)]
    return out


@FAST
@given(case=cp_case())
def test_shard_indices_follow_megatron_rule(case):
    row, layout, cp = case
    for rank in range(cp):
        idx = cp_shard_indices(layout, cp, rank)
        assert idx.dtype == torch.long and idx.numel() == layout.total_len // cp
        assert idx.tolist() == reference_indices(layout, cp, rank)


@FAST
@given(case=cp_case())
def test_shard_then_gather_is_identity(case):
    row, layout, cp = case
    shards = [cp_shard(row, layout, cp, r) for r in range(cp)]
    assert all(s.shape == (layout.total_len // cp, 3) for s in shards)
    assert torch.equal(cp_gather(shards, layout, cp), row)


@FAST
@given(case=cp_case())
def test_every_rank_gets_the_same_causal_work(case):
    # Causal attention cost of a token ~ its position in its sequence; rank r's chunks r and 2cp-1-r sum
    # to the same total for every rank.
    _, layout, cp = case
    work = [int(cp_shard(layout.position_ids, layout, cp, r).sum()) for r in range(cp)]
    assert len(set(work)) == 1


def test_gather_is_differentiable():
    row, layout = pack([torch.randn(5), torch.randn(3)], pad_multiple=4)
    shards = [cp_shard(row, layout, 2, r).requires_grad_() for r in range(2)]
    weights = torch.arange(layout.total_len, dtype=row.dtype)
    (cp_gather(shards, layout, 2) * weights).sum().backward()
    for r, shard in enumerate(shards):
        assert torch.equal(shard.grad, cp_shard(weights, layout, 2, r))


def test_bad_layouts_and_ranks():
    _, layout = pack([torch.ones(5), torch.ones(3)], pad_multiple=2)
    with pytest.raises(ValueError, match=r"sequence 0 has padded length 6 .* pad_multiple a multiple of 4"):
        cp_shard_indices(layout, 2, 0)
    _, layout = pack([torch.ones(5)], pad_multiple=4, total_multiple=10)  # tail of 2 tokens
    with pytest.raises(ValueError, match="total_multiple a multiple of 4"):
        cp_shard_indices(layout, 2, 0)
    _, layout = pack([torch.ones(5)], pad_multiple=4)
    with pytest.raises(ValueError, match=r"cp_rank=2 is outside \[0, cp_size=2\)"):
        cp_shard_indices(layout, 2, 2)
    with pytest.raises(ValueError, match="cp_size must be >= 1"):
        cp_shard_indices(layout, 0, 0)
    with pytest.raises(ValueError, match="got 1 shards"):
        cp_gather([torch.ones(4)], layout, 2)
    with pytest.raises(ValueError, match="shard of rank 1 has shape"):
        cp_gather([torch.ones(4), torch.ones(3)], layout, 2)


def test_one_cp_rank_holds_the_whole_row_for_any_layout():
    # cp_size=1 used to demand padded lengths that are multiples of 2 (the 2-chunk split of cp>1)
    row, layout = pack([torch.randn(5, 2), torch.randn(3, 2)], total_multiple=3)
    assert cp_shard_indices(layout, 1, 0).tolist() == list(range(layout.total_len))
    assert torch.equal(cp_shard(row, layout, 1, 0), row)
    assert torch.equal(cp_gather([row], layout, 1), row)
