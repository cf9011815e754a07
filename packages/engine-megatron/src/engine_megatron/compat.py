"""The one switch between CUDA and CPU: the CPU-compat module, applied only without CUDA.

Owns nothing but the choice; the patches themselves live in `engine_megatron.megatron_cpu` (one module for
the whole stack, see shared/notes/megatron-cpu-probe).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


def prepare_device() -> torch.device:
    """cuda if available; otherwise apply the CPU patches (idempotent) and use the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    from engine_megatron.megatron_cpu import ensure_cpu_compat

    ensure_cpu_compat()
    return torch.device("cpu")


@contextlib.contextmanager
def device_context() -> Iterator[None]:
    """Around megatron code that names 'cuda' literally (optimizer, schedules, checkpoints) on CPU."""
    if torch.cuda.is_available():
        yield
        return
    from engine_megatron.megatron_cpu import cpu_device_context

    with cpu_device_context():
        yield
