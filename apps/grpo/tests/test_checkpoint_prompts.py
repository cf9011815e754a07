"""Resumable prompt streams (the checkpoint manager: test_resume.py)."""

from __future__ import annotations

import pytest

from grpo_app.prompts import PromptSource
from rollout.datasets import PromptExample


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


def test_a_checkpoint_from_before_sizes_were_recorded_still_gets_the_position_check():
    items = [PromptExample(prompt=str(i), prompt_token_ids=[i]) for i in range(5)]
    source = PromptSource(items, seed=0)
    assert source.resume_problem({"epoch": 0, "position": 5}) is None
    assert "had more train prompts and had used 8 of epoch 0; this config gives 5" in source.resume_problem(
        {"epoch": 0, "position": 8})
