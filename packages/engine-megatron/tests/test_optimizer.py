"""The optimizer step: a non-finite gradient skips the update; the lr follows policy.scheduler."""

from __future__ import annotations

import math

import pytest
import torch
from megatron_testutil import LENGTHS, LOSS, POLICY, global_batch, make_policy

from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

SCHEDULE = {"warmup_steps": 2, "decay": "cosine", "total_steps": 5, "min_lr_ratio": 0.1}
LR = POLICY["optimizer"]["kwargs"]["lr"]


def _nan_loss(inputs):
    loss, metrics = ClippedPGLoss(LOSS)(inputs)
    return loss * float("nan"), metrics


def _skip(rank: int, world_size: int, ckpt: str) -> tuple[dict, bool, list[dict]]:
    from engine_megatron.engine import MegatronEngine

    # warming up: the lr moves every step, so a skipped step that advanced the schedule would show
    engine = MegatronEngine(make_policy(ckpt, {"tensor_model_parallel_size": world_size}, scheduler=SCHEDULE))
    batch = global_batch(0)
    before = engine.compute_logprobs(batch)
    batch = batch.with_fields(prev_logprobs=before)
    skipped = engine.train_batch(batch, _nan_loss)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.compute_logprobs(batch)))
    return skipped, unchanged, [engine.train_batch(batch, ClippedPGLoss(LOSS)) for _ in range(2)]


@pytest.mark.distributed
def test_non_finite_grad_norm_skips_the_step(tiny_ckpt) -> None:
    warm = SCHEDULE["warmup_steps"]
    for skipped, unchanged, after in run_distributed(_skip, world_size=2, args=(tiny_ckpt("qwen2"),)):
        assert skipped["skipped"] == 1.0 and not math.isfinite(skipped["grad_norm"]) and unchanged
        # training goes on normally afterwards, and the skipped step did not advance the schedule: the
        # next two steps are warmup steps 0 and 1 (lr / warm, 2 lr / warm), as the skipped one was step 0
        assert all(m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) for m in after), after
        lrs = [skipped["lr"], *(m["lr"] for m in after)]
        assert lrs == pytest.approx([LR / warm, LR / warm, 2 * LR / warm], rel=1e-12, abs=0), lrs


def _nan_prev_on_one_rank(rank: int, world_size: int, ckpt: str) -> tuple[dict, bool]:
    """DP=2; every token clipped (A = -1, r = e^-1 < 1 - eps: no gradient but through the clamp), and one
    valid prev logprob of DP rank 1 NaN. The NaN must still reach the gradient, so that both ranks skip."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt))
    batch = global_batch(0).select(range(rank, len(LENGTHS), world_size))
    before = engine.compute_logprobs(batch)
    prev = [lp + 1.0 for lp in before]
    if rank == 1:
        prev[0][-1] = float("nan")
    batch = batch.with_fields(prev_logprobs=prev, advantages=[-torch.ones(len(lp)) for lp in before])
    step = engine.train_batch(batch, ClippedPGLoss(LOSS))
    return step, all(torch.equal(a, b) for a, b in zip(before, engine.compute_logprobs(batch)))


@pytest.mark.distributed
def test_nan_logprob_on_one_dp_rank_skips_the_step_on_every_rank_even_when_all_tokens_clip(tiny_ckpt) -> None:
    for step, unchanged in run_distributed(_nan_prev_on_one_rank, world_size=2, args=(tiny_ckpt("qwen2"),)):
        assert step["nonfinite_logprob_tokens"] == 1.0 and step["skipped"] == 1.0, step
        assert not math.isfinite(step["grad_norm"]) and unchanged


def _lrs(rank: int, world_size: int, ckpt: str) -> list[float]:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, scheduler=SCHEDULE))
    batch = global_batch(0, lengths=[6, 5])
    batch = batch.with_fields(prev_logprobs=engine.compute_logprobs(batch))
    return [engine.train_batch(batch, ClippedPGLoss(LOSS))["lr"] for _ in range(7)]


@pytest.mark.distributed
def test_lr_follows_policy_scheduler(tiny_ckpt) -> None:
    """Linear warmup from lr/warmup, then cosine to min_lr_ratio * lr at total_steps, then flat."""
    lr, warm, total, floor = LR, 2, 5, 0.1

    def expected(step: int) -> float:  # written from the policy.scheduler docstring
        if step < warm:
            return lr * (step + 1) / warm
        progress = min(1.0, (step - warm) / (total - warm))
        return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    (lrs,) = run_distributed(_lrs, world_size=1, args=(tiny_ckpt("qwen2"),))
    assert lrs == pytest.approx([expected(s) for s in range(7)], rel=1e-12, abs=0)
