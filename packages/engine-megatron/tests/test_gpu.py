"""CUDA-only paths (skipped without a GPU by the root conftest; not run on the CPU machine this was built on).

Ranks are spawned with NCCL (`run_distributed(..., backend=CUDA_BACKEND)`): never forked after CUDA.
- packed sequences without transformer-engine (local attention, block-diagonal rows) and, with it, as
  THD `PackedSeqParams`;
- context parallelism (needs TE's attention), with seqpack's load-balanced layout;
- offload / onload of DDP buffers and optimizer state (a no-op on CPU).
Each compares with the single-GPU padded run, like the CPU layout tests.
"""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import assert_same_run, engine_run, make_policy

from rl_core.testing.distributed import CUDA_BACKEND, run_distributed

PACKING = {"sequence_packing": {"enabled": True, "train_mb_tokens": 32, "logprob_mb_tokens": 32}}


def _reference(ckpt: str) -> list[dict]:
    return run_distributed(engine_run, world_size=1, args=(ckpt, {}, {}), backend=CUDA_BACKEND)


@pytest.mark.gpu
def test_packing_equals_padded_on_gpu_with_or_without_te(tiny_ckpt) -> None:
    """The layout the machine has: THD with TE, block-diagonal rows through local attention without it
    (megatron's local DotProductAttention rejects THD); fusions limited to what imports."""
    ckpt = tiny_ckpt("qwen2")
    packed = run_distributed(engine_run, world_size=1, args=(ckpt, {}, PACKING), backend=CUDA_BACKEND)
    assert_same_run(packed, _reference(ckpt), logprob_tol=2e-5, weight_rel_tol=1e-5, weight_abs_tol=1e-4)


@pytest.mark.gpu
def test_thd_packing_equals_padded_on_gpu(tiny_ckpt) -> None:
    pytest.importorskip("transformer_engine")
    ckpt = tiny_ckpt("qwen2")
    packed = run_distributed(engine_run, world_size=1, args=(ckpt, {}, PACKING), backend=CUDA_BACKEND)
    assert_same_run(packed, _reference(ckpt), logprob_tol=2e-5, weight_rel_tol=1e-5, weight_abs_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.distributed
def test_context_parallel_equals_single_gpu(tiny_ckpt) -> None:
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs 2 GPUs")
    ckpt = tiny_ckpt("llama")
    cp = run_distributed(engine_run, world_size=2, args=(ckpt, {"context_parallel_size": 2}, PACKING),
                         backend=CUDA_BACKEND)
    assert_same_run(cp, _reference(ckpt), logprob_tol=2e-5, weight_rel_tol=1e-5, weight_abs_tol=1e-4)


def _offload(rank: int, world_size: int, ckpt: str) -> tuple[float, float, bool]:
    from megatron_testutil import global_batch

    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt))
    batch = global_batch(0)
    before = engine.compute_logprobs(batch)
    used = torch.cuda.memory_allocated()
    engine.offload()
    offloaded = torch.cuda.memory_allocated()
    engine.onload()
    after = engine.compute_logprobs(batch)
    return used, offloaded, all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.gpu
def test_offload_frees_gpu_memory_and_restores(tiny_ckpt) -> None:
    used, offloaded, same = run_distributed(_offload, world_size=1, args=(tiny_ckpt("qwen2"),), backend=CUDA_BACKEND)[0]
    assert same and offloaded < 0.5 * used, (used, offloaded)
