"""`count_cuda_syncs`: how many synchronizing CUDA calls a function makes (torch's sync debug mode).

A host read of a device tensor (`.item()`, `float(t)`, a device-to-host copy) makes the host wait for the
GPU to drain its queue; inside a layer that happens once per layer and micro-batch. The engines' GPU tests
count them for models of different depths. CUDA only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def count_cuda_syncs(fn: Callable[[], Any]) -> int:
    """Run `fn` with torch's CUDA sync debug mode on "warn" and count the synchronizing calls it reported."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)
