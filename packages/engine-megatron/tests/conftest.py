"""Shared fixtures: tiny HF checkpoints, a per-session conversion cache, the parent-process imports.

Multi-rank tests fork gloo workers with `rl_core.testing.distributed.run_distributed`; importing torch,
megatron and the engine here, once, is what makes a forked test cost ~1 s instead of a fresh import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # megatron_testutil (importlib import mode)

import megatron.core.dist_checkpointing  # noqa: E402, F401
import megatron.core.models.gpt  # noqa: E402, F401
import megatron.core.optimizer  # noqa: E402, F401
import megatron.core.pipeline_parallel  # noqa: E402, F401

import engine_megatron.engine  # noqa: E402, F401
from engine_megatron.megatron_cpu import ensure_cpu_compat  # noqa: E402

ensure_cpu_compat()


@pytest.fixture(scope="session", autouse=True)
def conversion_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Converted checkpoints of this session (the engine's cache root is RL_STACK_CACHE)."""
    root = tmp_path_factory.mktemp("mcore-cache")
    old = os.environ.get("RL_STACK_CACHE")
    os.environ["RL_STACK_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("RL_STACK_CACHE", None)
    else:
        os.environ["RL_STACK_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """arch -> path of a tiny HF checkpoint (vocab 100), built once per session."""
    from megatron_testutil import VOCAB

    from rl_core.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(save_tiny_checkpoint(root / arch, arch, seed=1, vocab_size=VOCAB))
        return built[arch]

    return get
