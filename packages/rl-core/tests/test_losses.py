"""The clipped PG loss against a per-token Python reference, and micro-batch / rank invariance."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.batch import LossInputs, TokenBatch
from rl_core.config import LossConfig
from rl_core.losses import ClippedPGLoss, clipped_pg_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def tokens_by_sequence(seq):
    out = {}
    for t, s in enumerate(seq):
        out.setdefault(s, []).append(t)
    return out


def reference_ratios(lp, prev, mask, seq, gspo):
    """Per-token ratio pi/pi_old; GSPO: the geometric mean over the sequence's unmasked tokens."""
    if not gspo:
        return [math.exp(a - b) for a, b in zip(lp, prev)]
    seq_tokens = tokens_by_sequence(seq)
    def seq_ratio(s):
        toks = [u for u in seq_tokens[s] if mask[u] > 0]
        return math.exp(sum(lp[u] - prev[u] for u in toks) / max(len(toks), 1))
    return [seq_ratio(s) for s in seq]


def loss_reference(lp, prev, adv, mask, seq, *, eps_low, eps_high, dual_clip, agg, n_tok, n_seq,
                   ref=None, kl_coef=0.0, gspo=False):
    """Python floats, straight from the formula in rl_core.losses' docstring (k3 KL, clamps 20/10)."""
    n = len(lp)
    seq_tokens = tokens_by_sequence(seq)
    ratios = reference_ratios(lp, prev, mask, seq, gspo)
    per_token = []
    for t in range(n):
        r = ratios[t]
        pg = max(-adv[t] * r, -adv[t] * min(max(r, 1 - eps_low), 1 + eps_high))
        if dual_clip is not None and adv[t] < 0:
            pg = min(pg, -adv[t] * dual_clip)
        if ref is not None and kl_coef:
            logr = min(max(ref[t] - lp[t], -20.0), 20.0)
            pg += kl_coef * min(max(math.exp(logr) - 1 - logr, -10.0), 10.0)
        per_token.append(pg)
    if agg == "token-mean":
        return sum(per_token[t] * mask[t] for t in range(n)) / n_tok
    total = 0.0
    for toks in seq_tokens.values():
        s = sum(per_token[t] * mask[t] for t in toks)
        count = sum(mask[t] for t in toks)
        total += (s / max(count, 1)) if agg == "seq-mean-token-mean" else s
    return total / n_seq


token_rows = st.lists(
    st.tuples(st.floats(-2, 0), st.floats(-2, 0), st.floats(-2, 2), st.sampled_from([0.0, 1.0, 1.0]),
              st.integers(0, 3), st.floats(-2, 0)),
    min_size=1, max_size=24,
)


@settings(max_examples=200, deadline=None)
@given(rows=token_rows, agg=st.sampled_from(AGGS), dual=st.sampled_from([None, 3.0]),
       eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.4)]), kl=st.sampled_from([0.0, 0.1]),
       gspo=st.booleans())
def test_loss_matches_reference(rows, agg, dual, eps, kl, gspo):
    rows = sorted(rows, key=lambda r: r[4])
    lp, prev, adv, mask, seq, ref = (list(col) for col in zip(*rows))
    n_tok, n_seq = 1.0 + sum(mask), 1.0 + len(set(seq))  # global counts can exceed the micro-batch's
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    loss, metrics = clipped_pg_loss(
        t(lp), t(prev), t(adv), t(mask), torch.tensor(seq), num_valid_tokens=n_tok, num_valid_seqs=n_seq,
        eps_low=eps[0], eps_high=eps[1], dual_clip=dual, agg=agg, ref_logprobs=t(ref), kl_coef=kl,
        sequence_level_ratio=gspo,
    )
    want = loss_reference(lp, prev, adv, mask, seq, eps_low=eps[0], eps_high=eps[1], dual_clip=dual, agg=agg,
                          n_tok=n_tok, n_seq=n_seq, ref=ref, kl_coef=kl, gspo=gspo)
    assert float(loss) == pytest.approx(want, rel=1e-10, abs=1e-12)
    clipped = sum(
        m for lp_, p, a, m in zip(lp, prev, adv, mask)
        if -a * min(max(math.exp(lp_ - p), 1 - eps[0]), 1 + eps[1]) > -a * math.exp(lp_ - p)
    )
    if not gspo:
        assert float(metrics["clip_fraction"]) == pytest.approx(clipped / n_tok, abs=1e-12)
    # the other metrics, each from its definition over the unmasked tokens
    ratios = reference_ratios(lp, prev, mask, seq, gspo)
    kept = [t for t in range(len(lp)) if mask[t] > 0]
    assert float(metrics["ratio_mean"]) == pytest.approx(sum(ratios[t] for t in kept) / n_tok, rel=1e-10, abs=1e-12)
    if kept:
        assert float(metrics["ratio_min"]) == pytest.approx(min(ratios[t] for t in kept), rel=1e-12)
        assert float(metrics["ratio_max"]) == pytest.approx(max(ratios[t] for t in kept), rel=1e-12)
    assert float(metrics["advantages_mean"]) == pytest.approx(sum(adv[t] for t in kept) / n_tok, abs=1e-12)
    k3 = [min(max(math.exp(r) - 1 - r, -10.0), 10.0) for r in (min(max(ref[t] - lp[t], -20.0), 20.0) for t in kept)]
    assert float(metrics["kl"]) == pytest.approx(sum(k3) / n_tok, rel=1e-10, abs=1e-12)
    if dual is not None:
        active = sum(1 for t in kept if adv[t] < 0 and max(-adv[t] * ratios[t], -adv[t] * min(
            max(ratios[t], 1 - eps[0]), 1 + eps[1])) > -adv[t] * dual)
        assert float(metrics["dual_clip_fraction"]) == pytest.approx(active / n_tok, abs=1e-12)


def test_on_policy_gradient_is_minus_advantage_over_tokens():
    """At ratio 1 with no clipping active, d loss / d logprob_t = -A_t / N_tok (token-mean)."""
    lp = torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    loss, _ = clipped_pg_loss(lp, lp.detach(), adv, torch.ones(3, dtype=torch.float64),
                              torch.zeros(3, dtype=torch.long), num_valid_tokens=3, num_valid_seqs=1)
    loss.backward()
    assert lp.grad.tolist() == pytest.approx((-adv / 3).tolist())


def random_batch(gen: random.Random, num_seqs: int) -> TokenBatch:
    lengths = [gen.randint(2, 9) for _ in range(num_seqs)]
    def vec(n, lo, hi):
        return torch.tensor([gen.uniform(lo, hi) for _ in range(n)], dtype=torch.float64)
    masks = []
    for n in lengths:
        m = torch.tensor([float(gen.random() < 0.8) for _ in range(n)], dtype=torch.float64)
        m[0] = 0.0
        masks.append(m)
    return TokenBatch(
        input_ids=[torch.zeros(n, dtype=torch.long) for n in lengths],
        loss_mask=masks,
        advantages=[torch.full((n,), gen.uniform(-2, 2), dtype=torch.float64) for n in lengths],
        prev_logprobs=[vec(n, -3, 0) for n in lengths],
        gen_logprobs=[vec(n, -3, 0) for n in lengths],
        ref_logprobs=[vec(n, -3, 0) for n in lengths],
    )


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("seed", range(5))
def test_micro_batch_and_rank_split_sum_to_full_batch(agg, seed):
    """Any split into 2 ranks x random micro-batches: summed losses and grads equal the full batch (1e-10)."""
    gen = random.Random(seed)
    batch = random_batch(gen, 12)
    params = [torch.tensor([gen.uniform(-3, 0) for _ in range(n)], dtype=torch.float64) for n in batch.lengths]
    cfg = LossConfig(agg=agg, dual_clip=3.0, kl_coef=0.05, eps_high=0.28)
    cfg.importance.enabled = True
    loss_fn = ClippedPGLoss(cfg)
    n_tok, n_seq = batch.num_valid_tokens(), batch.num_valid_seqs()

    def run(indices_list):
        grads = [torch.zeros_like(p) for p in params]
        total = 0.0
        for indices in indices_list:
            leaves = [params[i].clone().requires_grad_(True) for i in indices]
            inputs = LossInputs.from_sequences(batch.select(indices), leaves,
                                               num_valid_tokens=n_tok, num_valid_seqs=n_seq)
            loss, _ = loss_fn(inputs)
            loss.backward()
            total += float(loss)
            for i, leaf in zip(indices, leaves):
                grads[i] += leaf.grad
        return total, grads

    full_loss, full_grads = run([list(range(len(batch)))])
    order = list(range(len(batch)))
    gen.shuffle(order)
    ranks = [order[:5], order[5:]]
    micro = []
    for shard in ranks:
        cuts = sorted(gen.sample(range(1, len(shard)), k=min(2, len(shard) - 1)))
        micro += [shard[a:b] for a, b in zip([0, *cuts], [*cuts, len(shard)])]
    split_loss, split_grads = run(micro)
    assert split_loss == pytest.approx(full_loss, abs=1e-10)
    for a, b in zip(full_grads, split_grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert any(float(g.abs().sum()) > 0 for g in full_grads)


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)


def test_loss_requires_advantages():
    inputs = LossInputs(logprobs=torch.zeros(2), mask=torch.ones(2), seq_ids=torch.zeros(2, dtype=torch.long),
                        num_valid_tokens=2, num_valid_seqs=1)
    with pytest.raises(ValueError, match="advantages"):
        ClippedPGLoss()(inputs)


@pytest.mark.parametrize("agg", AGGS)
def test_without_prev_logprobs_the_loss_is_on_policy(agg):
    """prev_logprobs=None: the policy gradient at ratio 1 (pure-Python formula), IS against the training
    forward's logprobs, and the same loss/grads as passing those logprobs as prev explicitly."""
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -3.0], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    gen = torch.tensor([-1.0, -0.4, -2.5, -0.1, -2.0], dtype=torch.float64)
    seq = torch.tensor([0, 0, 0, 1, 1])
    cfg = LossConfig(agg=agg)
    cfg.importance.enabled = True
    inputs = LossInputs(logprobs=lp, mask=mask, seq_ids=seq, num_valid_tokens=4, num_valid_seqs=2,
                        advantages=adv, gen_logprobs=gen)
    loss, metrics = ClippedPGLoss(cfg)(inputs)
    loss.backward()
    w = [math.exp(a - b) for a, b in zip(lp.tolist(), gen.tolist())]  # token IS weight prev/gen, prev = lp
    per_token = {"token-mean": [1 / 4] * 5, "seq-mean-token-mean": [1 / (2 * 2)] * 3 + [1 / (2 * 2)] * 2,
                 "seq-mean-token-sum": [1 / 2] * 5}[agg]
    want = [-a * m * wi * c for a, m, wi, c in zip(adv.tolist(), mask.tolist(), w, per_token)]
    assert lp.grad.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert float(metrics["clip_fraction"]) == 0.0
    explicit = LossInputs(**{**vars(inputs), "logprobs": lp.detach().clone().requires_grad_(True),
                             "prev_logprobs": lp.detach().clone()})
    loss2, _ = ClippedPGLoss(cfg)(explicit)
    assert float(loss2) == pytest.approx(float(loss), abs=1e-15)


def test_a_batch_without_loss_tokens_has_a_zero_loss_and_undefined_token_means():
    """Every completion token masked (DAPO overlong filtering on a step of cut-off completions): the loss is 0 with a
    zero gradient, and the per-token means are NaN (logged as null); ratio_mean and entropy read 0.0 before."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    loss, metrics = clipped_pg_loss(lp, lp.detach() - 0.1, torch.ones(3), torch.zeros(3), torch.zeros(3, dtype=torch.long),
                                    num_valid_tokens=0.0, num_valid_seqs=1.0, entropy=torch.ones(3))
    loss.backward()
    assert float(loss) == 0.0 and lp.grad.abs().sum() == 0
    assert all(math.isnan(float(metrics[k])) for k in ("ratio_mean", "entropy", "clip_fraction", "advantages_mean"))
    assert math.isinf(float(metrics["ratio_min"])) and float(metrics["nonfinite_logprob_tokens"]) == 0
