"""Fixtures for engine-dtensor tests.

Every test that builds an engine runs it inside `run_distributed` (1 or 2 forked gloo ranks), so the
pytest process itself never initialises a process group (a forked child could not start its own).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rl_core.testing.tiny_models import cached_tiny_checkpoint


@pytest.fixture(scope="session")
def ckpt() -> Callable[[str], str]:
    """arch -> path of a cached tiny HF checkpoint (built once)."""
    return lambda arch: str(cached_tiny_checkpoint(arch))


@pytest.fixture(scope="session", autouse=True)
def _import_transformers_once() -> None:
    """Import the HF model code in the pytest process so every forked rank inherits it (saves ~s/rank)."""
    import transformers
    from transformers import AutoModelForCausalLM  # noqa: F401

    for name in (
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MistralForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        getattr(transformers, name)
