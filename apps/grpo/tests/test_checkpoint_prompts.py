"""Checkpoint manager (atomic, keep-top-k, latest) and resumable prompt streams."""

from __future__ import annotations

import pytest

from grpo_app.checkpoint import CheckpointManager
from grpo_app.prompts import PromptSource
from rollout.datasets import PromptExample


def fake_engine_save(path: str) -> None:
    from pathlib import Path

    Path(path).mkdir(parents=True)
    (Path(path) / "weights.bin").write_bytes(b"w")


def test_keep_top_k_by_metric_and_always_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="val/reward_mean", higher_is_better=True)
    for step, metric in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": metric})
    assert manager.steps() == [2, 4, 5]  # best two (0.9, 0.7) plus the latest
    assert manager.latest().name == "step_5" and manager.load_state(manager.latest())["step"] == 5


def test_failed_save_leaves_no_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="m", higher_is_better=True)

    def crash(path: str) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        manager.save(1, crash, {"step": 1})
    assert manager.latest() is None and not (tmp_path / "step_1").exists()


def test_prompt_source_resumes_exactly():
    items = [PromptExample(prompt=str(i), prompt_token_ids=[i]) for i in range(7)]
    uninterrupted = PromptSource(items, seed=3)
    expected = [p.prompt for _ in range(5) for p in uninterrupted.next_batch(4)]
    first = PromptSource(items, seed=3)
    got = [p.prompt for _ in range(2) for p in first.next_batch(4)]
    resumed = PromptSource(items, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [p.prompt for _ in range(3) for p in resumed.next_batch(4)]
    assert got == expected
    assert sorted(expected[:7]) == sorted(str(i) for i in range(7))  # each epoch visits every prompt once


def test_empty_prompt_set_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)
