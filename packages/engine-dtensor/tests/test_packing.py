"""Packing and micro-batching change no result (one rank).

packed == padded == one sequence per forward, for logprobs and gradients; and one GRPO update is the
same whatever the micro-batch size, token budget or packing, because the loss uses global normalisers.
"""

from __future__ import annotations

import pytest

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import assert_layout_close, full_grads, grpo_batch, make_policy, max_abs_diff
from rl_core.config import LossConfig
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

LAYOUTS = {
    "one-at-a-time": {"train_micro_batch_size": 1, "logprob_batch_size": 1},
    "padded": {"train_micro_batch_size": 8, "logprob_batch_size": 8},
    # the default on CPU: sdpa_segments, one causal sdpa per packed sequence
    "packed": {"sequence_packing": {"enabled": True, "train_mb_tokens": 256, "logprob_mb_tokens": 256}},
    "packed sdpa mask": {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 256, "logprob_mb_tokens": 256},
        "dtensor_cfg": {"attn_implementation": "sdpa"},
    },
    # eager attention adds the mask to the scores: the engine must hand it an additive float mask
    "packed eager": {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 256, "logprob_mb_tokens": 256},
        "dtensor_cfg": {"attn_implementation": "eager"},
    },
}
BUDGETS = {
    "micro-batch 3": {"train_micro_batch_size": 3},
    "dynamic 40 tokens": {
        "dynamic_batching": {"enabled": True, "train_mb_tokens": 40, "sequence_length_round": 4}
    },
    "packed 30 tokens ffd": {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 30, "algorithm": "ffd"}
    },
    "packed 64 tokens": {"sequence_packing": {"enabled": True, "train_mb_tokens": 64}},
}


# The attention each layout names (the engine's choice and the one the HF model dispatches on): "auto"
# (the other layouts) resolves to sdpa_segments on the CPU.
ATTENTION = {"packed sdpa mask": "sdpa", "packed eager": "eager"}


def _logprobs_and_grads(rank: int, world: int, path: str, batch, overrides: dict) -> tuple:
    engine = DTensorEngine(make_policy(path, **overrides))
    logprobs = engine.compute_logprobs(batch)
    result = engine.forward_backward(batch, ClippedPGLoss(LossConfig(agg="seq-mean-token-mean")))
    attention = (engine.attn_impl, engine.model.config._attn_implementation)
    return logprobs, full_grads(engine), result.num_micro_batches, attention


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_packed_equals_padded_equals_one_at_a_time(ckpt, arch: str) -> None:
    batch = grpo_batch(ckpt(arch))
    runs = {
        name: run_distributed(_logprobs_and_grads, 1, args=(ckpt(arch), batch, cfg))[0]
        for name, cfg in LAYOUTS.items()
    }
    ref_lp, ref_grads, *_ = runs["one-at-a-time"]
    assert [run[2] for run in runs.values()] == [8, 1, 1, 1, 1]  # the layouts really differ
    for name, run in runs.items():  # and each ran the attention it names
        assert run[3] == (ATTENTION.get(name, "sdpa_segments"),) * 2, name
    for name in ("padded", "packed", "packed sdpa mask", "packed eager"):
        lp_diff = assert_layout_close(runs[name][0], ref_lp)
        grad_diff = assert_layout_close(runs[name][1], ref_grads)
        print(f"{arch} {name} vs one-at-a-time: max|dlogprob| = {lp_diff:.2e}, max|dgrad| = {grad_diff:.2e}")


# SGD: the update is linear in the clipped gradient. (Adam's first step is ~lr * sign(g), which turns
# 1e-10 rounding noise in near-zero gradients into 1e-5 parameter differences at lr 1e-3.)
SGD = {"name": "SGD", "kwargs": {"lr": 0.5}}


def _one_update(rank: int, world: int, path: str, batch, overrides: dict) -> tuple:
    engine = DTensorEngine(make_policy(path, optimizer=SGD, **overrides))
    metrics = engine.train_batch(batch, ClippedPGLoss())
    return metrics, dict(engine.export_hf_weights())


def test_one_grpo_update_independent_of_micro_batching(ckpt) -> None:
    batch = grpo_batch(ckpt("qwen2"))
    ref_metrics, ref_params = run_distributed(
        _one_update, 1, args=(ckpt("qwen2"), batch, {"train_micro_batch_size": 8})
    )[0]
    assert ref_metrics["num_micro_batches"] == 1
    for name, cfg in BUDGETS.items():
        metrics, params = run_distributed(_one_update, 1, args=(ckpt("qwen2"), batch, cfg))[0]
        assert metrics["num_micro_batches"] > 1, name
        for key in ("loss", "grad_norm", "pg_loss", "clip_fraction", "entropy", "ratio_max"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6, rel=1e-6), (name, key)
        diff = max_abs_diff(params, ref_params)
        print(
            f"{name}: {int(metrics['num_micro_batches'])} micro-batches, max|dparam| = {diff:.2e}, "
            f"|dloss| = {abs(metrics['loss'] - ref_metrics['loss']):.2e}"
        )
        assert diff <= 1e-6, name
