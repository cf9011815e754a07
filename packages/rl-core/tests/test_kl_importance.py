"""KL estimators and importance weights against float64 references written per token in Python."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.importance import importance_weights
from rl_core.kl import kl_penalty

logps = st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=16)


def kl_ref(lp: float, ref: float, kind: str, cin: float | None, cout: float | None) -> float:
    logr = ref - lp
    if cin is not None:
        logr = min(max(logr, -cin), cin)
    value = {"k1": -logr, "k2": logr * logr / 2, "k3": math.exp(logr) - 1 - logr}[kind]
    if cout is not None:
        value = min(max(value, -cout), cout)
    return value


@settings(max_examples=100, deadline=None)
@given(a=logps, b=logps, kind=st.sampled_from(["k1", "k2", "k3"]),
       cin=st.sampled_from([None, 20.0, 1.0]), cout=st.sampled_from([None, 10.0, 0.5]))
def test_kl_matches_reference(a, b, kind, cin, cout):
    n = min(len(a), len(b))
    lp, ref = torch.tensor(a[:n], dtype=torch.float64), torch.tensor(b[:n], dtype=torch.float64)
    got = kl_penalty(lp, ref, kind, input_clamp=cin, output_clamp=cout)
    want = [kl_ref(x, y, kind, cin, cout) for x, y in zip(a[:n], b[:n])]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_k3_is_nonnegative_and_zero_at_equality():
    lp = torch.randn(100, dtype=torch.float64)
    assert kl_penalty(lp, lp).abs().max() == 0
    assert (kl_penalty(lp, lp + torch.randn(100, dtype=torch.float64)) >= 0).all()


def test_unknown_kl_kind_names_choices():
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def is_reference(prev, gen, mask, seq, level, mode, low, high):
    """Per-token weights computed with Python floats from the module docstring's definitions."""
    n = len(prev)
    clamp = lambda x: min(max(x, -20.0), 20.0)  # noqa: E731  (the documented log-ratio bound)
    log_w = [clamp(prev[t] - gen[t]) * mask[t] for t in range(n)]
    if level == "sequence":
        sums = {}
        for t in range(n):
            sums[seq[t]] = sums.get(seq[t], 0.0) + log_w[t]
        log_w = [clamp(sums[seq[t]]) for t in range(n)]
    raw = [math.exp(x) for x in log_w]
    if mode is None:
        w = raw
    elif mode == "tis":
        w = [min(max(x, low), high) for x in raw]
    elif mode == "icepop":
        w = [x if low <= x <= high else 0.0 for x in raw]
    else:
        seq_mean = {}
        for s in set(seq):
            toks = [t for t in range(n) if seq[t] == s and mask[t] > 0]
            seq_mean[s] = sum(prev[t] - gen[t] for t in toks) / max(len(toks), 1)
        w = []
        for t in range(n):
            ratio = math.exp(seq_mean[seq[t]])
            w.append(0.0 if not low <= ratio <= high else min(math.exp(prev[t] - gen[t]), high))
    return [w[t] * mask[t] for t in range(n)]


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(st.tuples(st.floats(-5, 0), st.floats(-5, 0), st.sampled_from([0.0, 1.0]), st.integers(0, 3)),
                  min_size=1, max_size=20),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from([None, "tis", "icepop", "seq-mask-tis"]),
    bounds=st.sampled_from([(0.0, 2.0), (0.5, 1.5), (0.9, 1.1)]),
)
def test_importance_weights_match_reference(data, level, mode, bounds):
    prev = [d[0] for d in data]
    gen = [d[1] for d in data]
    mask = [d[2] for d in data]
    seq = sorted(d[3] for d in data)
    low, high = bounds
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    weights, metrics = importance_weights(t(prev), t(gen), t(mask), torch.tensor(seq), level=level, mode=mode,
                                          low=low, high=high)
    want_w = is_reference(prev, gen, mask, seq, level, mode, low, high)
    assert weights.tolist() == pytest.approx(want_w, rel=1e-10, abs=1e-12)
    valid = max(sum(mask), 1)
    assert float(metrics["is_weight_mean"]) == pytest.approx(sum(want_w) / valid, rel=1e-10, abs=1e-12)
    assert float(metrics["is_weight_max"]) == pytest.approx(max(want_w), rel=1e-10, abs=1e-12)
    # out of bounds: the weight a bound changed (clamped or zeroed; seq-mask-tis: the sequence's mean ratio)
    untouched = is_reference(prev, gen, mask, seq, level, None, low, high)
    if mode == "seq-mask-tis":
        oob = sum(1 for t in range(len(prev)) if mask[t] and want_w[t] == 0.0)
    elif mode is not None:
        oob = sum(1 for t in range(len(prev)) if mask[t] and not low <= untouched[t] <= high)
    else:
        oob = 0
    assert float(metrics["is_oob_fraction"]) == pytest.approx(oob / valid, abs=1e-12)
    want_err = sum(math.exp(abs(g - p)) * m for p, g, m in zip(prev, gen, mask)) / valid
    assert float(metrics["token_mult_prob_error"]) == pytest.approx(want_err, rel=1e-12)
    assert float(metrics["gen_kl"]) == pytest.approx(sum((g - p) * m for p, g, m in zip(prev, gen, mask)) / valid,
                                                     abs=1e-12)


def test_identical_policies_give_unit_weights_and_unit_error():
    lp = -torch.rand(10, dtype=torch.float64)
    mask = torch.ones(10, dtype=torch.float64)
    w, m = importance_weights(lp, lp, mask, torch.zeros(10, dtype=torch.long), mode="icepop")
    assert torch.equal(w, mask) and float(m["token_mult_prob_error"]) == 1.0
    assert float(m["is_oob_fraction"]) == 0.0


def test_bad_mode_names_choices():
    with pytest.raises(ValueError, match="icepop"):
        importance_weights(torch.zeros(1), torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long),
                           mode="clip")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", [None, "tis", "icepop", "seq-mask-tis"])
def test_nan_sampler_logprob_gets_weight_zero_and_counts_out_of_bounds(level, mode):
    """A NaN gen logprob (a sampler glitch, not the trainer's numerics) zeroes the weight it enters, as
    seq-mask-tis always did, instead of making the loss NaN and the whole step skipped."""
    prev = [-1.0, -1.2, -0.7, -2.0, -0.9]
    gen = [-1.1, float("nan"), -0.8, -1.9, -1.0]
    seq = [0, 0, 0, 1, 1]
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    weights, metrics = importance_weights(t(prev), t(gen), torch.ones(5, dtype=torch.float64), torch.tensor(seq),
                                          level=level, mode=mode, low=0.5, high=2.0)
    # the reference without the NaN token; the weights it enters (its token, or its whole sequence) are 0
    clean = [0, 2, 3, 4]
    ref = is_reference([prev[i] for i in clean], [gen[i] for i in clean], [1.0] * 4, [seq[i] for i in clean],
                       level, mode, 0.5, 2.0)
    whole_sequence = level == "sequence" or mode == "seq-mask-tis"
    want = {i: 0.0 if whole_sequence and seq[i] == 0 else w for i, w in zip(clean, ref)}
    want[1] = 0.0
    assert weights.tolist() == pytest.approx([want[i] for i in range(5)], rel=1e-10, abs=1e-12)
    zeroed = 3 if whole_sequence else 1
    assert float(metrics["is_oob_fraction"]) == pytest.approx(zeroed / 5, abs=1e-12)
    # the mismatch metrics are of the four known tokens (the unknown one counts as none: exp(0) = 1, a log-ratio of 0)
    known = [math.exp(abs(gen[i] - prev[i])) for i in clean]
    assert float(metrics["token_mult_prob_error"]) == pytest.approx((sum(known) + 1.0) / 5, rel=1e-12)
    assert float(metrics["gen_kl"]) == pytest.approx(sum(gen[i] - prev[i] for i in clean) / 5, rel=1e-12)


def test_minus_inf_sampler_logprob_leaves_gen_kl_finite():
    """A sampler logprob of -inf on a valid token: gen_kl is clamped as the weights' log-ratio is (+-20), not -inf."""
    prev, gen = torch.tensor([-1.0, -0.5]), torch.tensor([-1.5, float("-inf")])
    _, metrics = importance_weights(prev, gen, torch.ones(2), torch.zeros(2, dtype=torch.long), mode="tis")
    assert float(metrics["gen_kl"]) == pytest.approx((-0.5 - 20.0) / 2, rel=1e-6)
    assert float(metrics["token_mult_prob_error"]) == pytest.approx((math.exp(0.5) + math.exp(20.0)) / 2, rel=1e-5)
