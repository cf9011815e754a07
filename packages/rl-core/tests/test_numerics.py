"""Masked tokens, -inf logprobs and huge log-ratios (issue 17): finite results, checked against float64
references computed per token in Python over the valid tokens only."""

from __future__ import annotations

import math

import pytest
import torch

from rl_core.importance import importance_weights
from rl_core.losses import clipped_pg_loss

F32 = torch.float32


def test_masked_prompt_token_far_from_gen_keeps_token_mult_prob_error_finite():
    prev, gen, mask = [0.0, -90.0, -1.0, -1.2], [0.0, 0.0, -1.1, -1.2], [0.0, 0.0, 1.0, 1.0]
    _, metrics = importance_weights(torch.tensor(prev, dtype=F32), torch.tensor(gen, dtype=F32),
                                    torch.tensor(mask, dtype=F32), torch.zeros(4, dtype=torch.long))
    want = sum(math.exp(abs(g - p)) for p, g, m in zip(prev, gen, mask) if m) / sum(mask)
    got = float(metrics["token_mult_prob_error"])
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-6)
    assert float(metrics["gen_kl"]) == pytest.approx(sum(g - p for p, g, m in zip(prev, gen, mask) if m) / 2,
                                                     rel=1e-5)


def test_minus_inf_on_masked_token_keeps_loss_finite_and_seq_mask_tis_rejects_out_of_bounds_sequence():
    # sequence 0: valid tokens in bounds; sequence 1: valid tokens far out of bounds; both hold a masked -inf
    inf = float("-inf")
    prev = torch.tensor([inf, -1.0, -1.1, inf, -0.1, -0.2], dtype=F32)
    gen = torch.tensor([-0.5, -1.05, -1.0, -0.5, -3.0, -3.0], dtype=F32)
    mask = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=F32)
    seq = torch.tensor([0, 0, 0, 1, 1, 1])
    weights, metrics = importance_weights(prev, gen, mask, seq, mode="seq-mask-tis", low=0.5, high=2.0)
    want = []
    for t in range(6):  # float64 reference: geometric-mean ratio of each sequence's valid tokens
        toks = [u for u in range(6) if int(seq[u]) == int(seq[t]) and mask[u] > 0]
        ratio = math.exp(sum(float(prev[u]) - float(gen[u]) for u in toks) / len(toks))
        keep = mask[t] > 0 and 0.5 <= ratio <= 2.0
        want.append(min(math.exp(float(prev[t]) - float(gen[t])), 2.0) if keep else 0.0)
    assert want[4] == want[5] == 0.0 and want[1] > 0  # the case is the one meant
    assert weights.tolist() == pytest.approx(want, rel=1e-6)
    assert all(math.isfinite(float(v)) for v in metrics.values())

    lp = torch.tensor([inf, -1.0, -1.0, inf, -0.2, -0.1], dtype=F32, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=F32)
    loss, pg_metrics = clipped_pg_loss(lp, prev, adv, mask, seq, num_valid_tokens=4, num_valid_seqs=2,
                                       is_weights=weights, ref_logprobs=prev, kl_coef=0.1, kl_input_clamp=None)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(lp.grad).all()
    assert float(pg_metrics["nonfinite_logprob_tokens"]) == 0.0
    # float64 reference over valid tokens: token-mean of w * max(-A r, -A clip(r)) + 0.1 * k3
    total = 0.0
    for t in (1, 2, 4, 5):
        r = math.exp(float(lp[t]) - float(prev[t]))
        pg = max(-float(adv[t]) * r, -float(adv[t]) * min(max(r, 0.8), 1.2))
        logr = float(prev[t]) - float(lp[t])
        total += float(weights[t]) * pg + 0.1 * min(max(math.exp(logr) - 1 - logr, -10), 10)
    assert float(loss) == pytest.approx(total / 4, rel=1e-5)


@pytest.mark.parametrize("log_ratio", [88.7, 100.0, 1000.0])
def test_huge_log_ratio_gives_finite_gradient_equal_to_clamped_reference(log_ratio):
    prev = torch.tensor([-log_ratio - 1.0, -1.0], dtype=F32)
    lp = torch.tensor([-1.0, -1.5], dtype=F32, requires_grad=True)
    adv = torch.tensor([-1.0, 2.0], dtype=F32)
    mask = torch.ones(2, dtype=F32)
    loss, _ = clipped_pg_loss(lp, prev, adv, mask, torch.tensor([0, 0]), num_valid_tokens=2, num_valid_seqs=1)
    loss.backward()
    assert math.isfinite(float(loss)) and torch.isfinite(lp.grad).all()
    # float64 reference: token 0's log-ratio is clamped to 20 (gradient 0 through the clamp), A < 0 so the
    # unclipped term -A*r = exp(20) is the max; token 1: r = exp(-0.5) < 1 - eps, A > 0 -> clipped, grad 0
    want_loss = (math.exp(20.0) + max(-2.0 * math.exp(-0.5), -2.0 * 0.8)) / 2
    assert float(loss) == pytest.approx(want_loss, rel=1e-6)
    assert lp.grad.tolist() == [0.0, pytest.approx(-2.0 * math.exp(-0.5) / 2, rel=1e-6)]


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_nonfinite_logprob_on_valid_token_is_counted_and_poisons_the_gradient(bad):
    """Counted in a metric, and the gradient is non-finite so that optimizer_step skips the step."""
    prev = torch.tensor([-1.0, bad, -1.0], dtype=F32)
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=F32, requires_grad=True)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=F32)
    loss, metrics = clipped_pg_loss(lp, prev, torch.ones(3), mask, torch.zeros(3, dtype=torch.long),
                                    num_valid_tokens=2, num_valid_seqs=1)
    loss.backward()
    assert float(metrics["nonfinite_logprob_tokens"]) == 1.0
    assert not torch.isfinite(lp.grad).all()



@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_nonfinite_logprob_poisons_the_gradient_when_every_other_token_is_clipped(bad):
    """A < 0 and r = e^-1 < 1 - eps on the clean tokens: max(-A r, -A clip(r)) takes the clipped branch, whose
    gradient is 0 through the clamp. The NaN must still reach the gradient, or the step runs on a NaN loss."""
    prev = torch.tensor([0.0, bad, 0.0], dtype=F32)
    lp = torch.tensor([-1.0, -1.0, -1.0], dtype=F32, requires_grad=True)
    loss, metrics = clipped_pg_loss(lp, prev, -torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long),
                                    num_valid_tokens=3, num_valid_seqs=1)
    loss.backward()
    assert float(metrics["nonfinite_logprob_tokens"]) == 1.0 and math.isnan(float(loss.detach()))
    assert not torch.isfinite(lp.grad).any()

