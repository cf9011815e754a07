"""Shared fixtures: tiny HF checkpoints (built once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # for ckpt_convert_testutil (importlib import mode)

import megatron.core.dist_checkpointing  # noqa: E402, F401

# Import megatron (3-4 s) and apply the CPU patches once in the parent: run_distributed forks workers
# that inherit both instead of paying the import per test. The conversion itself needs no patches; the
# tests that build a GPTModel to compare logits use engine-megatron's builder and CPU layer (a test-only
# import: engine-megatron depends on ckpt-convert, not the reverse).
import megatron.core.models.gpt  # noqa: E402, F401
from ckpt_convert_testutil import ARCHS  # noqa: E402

from engine_megatron.megatron_cpu import ensure_cpu_compat  # noqa: E402

ensure_cpu_compat()


def _warm_megatron_save_queue() -> None:
    """megatron's torch_dist save starts a *spawned* multiprocessing Manager on its first call in a process
    and caches it in a module global. Create it once here, so the forked test workers inherit the proxy
    instead of each spawning a Manager (seconds per worker). megatron-core 0.16 names the function
    `_get_write_results_queue`, 0.19 `get_write_results_queue`."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    get_queue = (getattr(filesystem_async, "get_write_results_queue", None)
                 or filesystem_async._get_write_results_queue)
    get_queue()


_warm_megatron_save_queue()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """arch -> path of a tiny HF checkpoint (vocab 100: not a multiple of 128, so padding is exercised)."""
    from rl_core.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {arch: save_tiny_checkpoint(root / arch, arch, seed=3, vocab_size=100) for arch in ARCHS}


@pytest.fixture(scope="session")
def ref_logits(tiny_ckpts: dict) -> dict:
    """arch -> HF logits for TOKENS (the independent reference every megatron logits test compares to)."""
    from ckpt_convert_testutil import hf_logits

    return {arch: hf_logits(path) for arch, path in tiny_ckpts.items()}
