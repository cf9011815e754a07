"""What a policy rank adds to the engine's training metrics: the GPU memory peak, the largest over the ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_app.workers import PolicyWorker
from rl_core.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed

PEAK_BYTES = {0: 3 * 2**30, 1: 5 * 2**30}  # rank 1 holds the longer DP shard: the higher peak


class _Engine:
    def train_batch(self, batch, loss_fn) -> dict[str, float]:
        return {"loss": 0.5}


def _train_on_rank(rank: int, world_size: int) -> dict[str, float]:
    torch.cuda.is_available = lambda: True  # this forked rank's CUDA is stood in for: only the peak is read
    torch.cuda.max_memory_allocated = lambda device=None: PEAK_BYTES[rank]
    worker = SimpleNamespace(engine=_Engine())
    return PolicyWorker.__ray_actor_class__.train(worker, batch=None, loss_fn=None)


def test_gpu_memory_peak_is_the_largest_over_the_policy_ranks():
    """Workers.train logs rank 0's metrics, so every rank must report the peak of the ranks (it reported its own:
    3 GiB where rank 1 reached 5)."""
    results = run_distributed(_train_on_rank, world_size=2)
    expected = max(PEAK_BYTES.values()) / 2**30
    assert [r["gpu_allocated_gib_max"] for r in results] == [expected, expected]
    assert all(r["loss"] == 0.5 for r in results)
