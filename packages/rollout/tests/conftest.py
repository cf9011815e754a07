"""Shared fixtures: tiny HF checkpoints built locally (rl_core.testing.tiny_models), never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.testing.tiny_models import build_tokenizer, cached_tiny_checkpoint

PROMPT_TEXTS = ["1+2=", "Hello there, how", "x", "The quick brown fox jumps", "7*8"]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_ckpt(model_cache: Path) -> Path:
    return cached_tiny_checkpoint("qwen2", seed=0, cache_dir=model_cache)


@pytest.fixture(scope="session")
def tiny_ckpt_other(model_cache: Path) -> Path:
    return cached_tiny_checkpoint("qwen2", seed=1, cache_dir=model_cache)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return [[tokenizer.bos_token_id] + tokenizer.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
