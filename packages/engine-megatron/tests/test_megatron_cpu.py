"""The CPU compatibility layer: idempotent, and the device context really redirects 'cuda' allocations."""

from __future__ import annotations

import pytest
import torch

from engine_megatron.megatron_cpu import cpu_device_context, ensure_cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_ensure_cpu_compat_is_idempotent() -> None:
    first = ensure_cpu_compat()
    assert "rng-tracker->cpu-generator" in first and "causal-mask->cpu" in first
    assert ensure_cpu_compat() == first
    assert torch.cuda.current_device() == torch.device("cpu")


def test_cpu_device_context_redirects_cuda() -> None:
    with cpu_device_context():
        x = torch.zeros(3, device="cuda")
        assert x.device.type == "cpu"
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"  # megatron's optimizers check this string
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_rng_tracker_fork_is_reproducible_and_isolated() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    ensure_cpu_compat()
    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 123)
    torch.manual_seed(0)
    outer = torch.rand(2)
    torch.manual_seed(0)
    with tracker.fork("a"):
        inside = torch.rand(4)
    assert torch.equal(torch.rand(2), outer)  # the default stream is untouched by the fork
    expected = torch.rand(4, generator=torch.Generator().manual_seed(123))
    assert torch.equal(inside, expected)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("b"):
            pass
