"""The default toy task is learnable: minimal GRPO (rollout torch backend + repeat_char environment +
rl_core advantages and loss + HF model + AdamW) raises held-out greedy reward by >= 0.3 on one core."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "learnability.py"


@pytest.mark.slow
def test_grpo_raises_validation_reward_on_repeat_char(model_cache):
    spec = importlib.util.spec_from_file_location("rollout_bench_learnability", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    cfg = bench.ToyRunConfig(max_steps=200, max_seconds=150.0, stop_at_gain=0.3)
    result = bench.run_grpo(cfg, cache_dir=str(model_cache))
    initial = result.curve[0][2]
    assert initial < 0.15, f"an untrained model should score near 0, got {initial}"
    assert result.curve[-1][2] - initial >= 0.3, f"validation curve (step, s, reward): {result.curve}"
