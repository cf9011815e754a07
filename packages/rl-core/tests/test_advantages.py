"""Advantages against float64 references written from the definitions, one group at a time."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages
from rl_core.filters import dynamic_sampling_keep, overlong_loss_mask

EPS = 1e-6


def reference(rewards: list[float], groups: list[int], normalize_std: bool, leave_one_out: bool) -> list[float]:
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        if len(members) == 1:
            out.append(0.0)
            continue
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        pool = others if leave_one_out else members
        adv = r - statistics.fmean(pool)
        if normalize_std and len(pool) >= 2:
            std = statistics.stdev(pool)  # Bessel
            if std > 0:
                adv = adv / (std + EPS)
        out.append(adv)
    return out


group_batches = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([0.0, 0.5, 1.0, -1.0]) | st.floats(-3, 3).filter(lambda x: x == 0 or abs(x) > 1e-100)),  # no underflow in x**2
    min_size=1,
    max_size=24,
)


@settings(max_examples=150, deadline=None)
@given(batch=group_batches, normalize_std=st.booleans(), leave_one_out=st.booleans(), batch_normalize=st.booleans())
def test_grpo_advantages_match_reference(batch, normalize_std, leave_one_out, batch_normalize):
    groups = [g for g, _ in batch]
    rewards = [r for _, r in batch]
    got = grpo_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(groups),
        normalize_std=normalize_std,
        leave_one_out=leave_one_out,
        batch_normalize=batch_normalize,
        eps=EPS,
    )
    want = reference(rewards, groups, normalize_std, leave_one_out)
    if batch_normalize:  # REINFORCE++: whiten over the whole batch
        mean = statistics.fmean(want)
        std = statistics.stdev(want) if len(want) > 1 else 0.0
        want = [(a - mean) / (std + EPS) for a in want]
    assert got.tolist() == pytest.approx(want, abs=1e-9)


def test_group_of_one_and_zero_variance_groups_get_zero():
    rewards = torch.tensor([1.0, 0.7, 0.7, 0.7, 0.3], dtype=torch.float64)
    groups = torch.tensor([0, 1, 1, 1, 2])
    for loo in (False, True):
        assert grpo_advantages(rewards, groups, leave_one_out=loo).abs().max() < 1e-12


def test_rloo_is_leave_one_out_mean_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 5.0], dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 9, 9])
    want = [1 - 0, 0 - 0.5, 0 - 0.5, 2 - 5, 5 - 2]
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx(want)


def test_clip_bounds_advantages():
    rewards = torch.tensor([0.0, 0.0, 0.0, 10.0], dtype=torch.float64)
    adv = grpo_advantages(rewards, torch.zeros(4, dtype=torch.long), normalize_std=False, clip=2.0)
    assert adv.tolist() == pytest.approx([-2.0, -2.0, -2.0, 2.0])


def test_reinforce_pp_whitens_over_batch():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 8.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    centred = [1 - 1.5, 2 - 1.5, 3 - 3.5, 4 - 3.5, 0 - 4.0, 8 - 4.0]
    mean = statistics.fmean(centred)
    std = statistics.stdev(centred)
    want = [(x - mean) / (std + 1e-6) for x in centred]
    assert reinforce_pp_advantages(rewards, groups).tolist() == pytest.approx(want)


def test_batch_normalize_comes_before_the_clip():
    rewards = torch.tensor([0.0, 0.0, 0.0, 10.0, 1.0, 3.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = grpo_advantages(rewards, groups, normalize_std=False, batch_normalize=True, clip=1.0)
    centred = [-2.5, -2.5, -2.5, 7.5, -1.0, 1.0]
    mean, std = statistics.fmean(centred), statistics.stdev(centred)
    assert adv.tolist() == pytest.approx([max(-1.0, min(1.0, (x - mean) / (std + EPS))) for x in centred])


def test_mismatched_shapes_raise():
    with pytest.raises(ValueError, match="1-D of equal length"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_dynamic_sampling_keeps_only_groups_with_reward_variance():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    assert dynamic_sampling_keep(rewards, groups).tolist() == [False, False, True, True, False, False]


def test_overlong_filter_zeroes_truncated_masks():
    masks = [torch.ones(3), torch.ones(2)]
    out = overlong_loss_mask(masks, [True, False])
    assert out[0].sum() == 0 and torch.equal(out[1], masks[1])
    assert not math.isnan(float(out[0].sum()))


def test_float32_constant_pools_are_exact():
    """Rounding of a constant group's mean must not become a tiny std that 1/(std+eps) amplifies."""
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 0.0], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert grpo_advantages(rewards, groups)[:3].abs().max() == 0
    # Leave-one-out: member 3's others are {0, 0}, a constant pool: advantage 1 - 0, not divided.
    loo = grpo_advantages(rewards, groups, leave_one_out=True)
    assert loo[:3].abs().max() == 0 and float(loo[3]) == 1.0
