"""Neither engine reads tensor values on the host inside the model's forward or backward.

On a GPU each such read (`.item()`, `.tolist()`, a boolean mask, HF detecting packed rows from position ids)
waits for the GPU to drain its queue, once per layer or micro-batch; the GPU tests count those syncs, but
they run only where a GPU is lent. This counts the same calls on the CPU (rl_core.testing.host_reads) in a
packed training pass and a logprob pass of each engine. Ignored: seqpack's per-sequence attention, the CPU
branch of the packed attention, which reads the lengths by design (on CUDA one varlen kernel call takes
them as a tensor and the micro-batch's host-side max length).
"""

from __future__ import annotations

import pytest

from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import cached_tiny_checkpoint

VOCAB = 128
LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6, 11, 4, 32]  # 32: a row of one sequence
CPU_ONLY_READS = [("seqpack/attention.py", "packed_causal_attention"), ("seqpack/attention.py", "_host_lengths")]


def _reads(rank: int, world_size: int, engine_name: str, ckpt: str) -> dict:
    from rl_core.config import PolicyConfig, parse_config
    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine
    from rl_core.testing.contracts import random_token_batch
    from rl_core.testing.host_reads import HostReads

    policy = parse_config(PolicyConfig, {
        "model_name": ckpt, "engine": engine_name, "precision": "float32", "train_micro_batch_size": 4,
        "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3}},
        # several sequences per packed row, several rows per pass
        "sequence_packing": {"enabled": True, "train_mb_tokens": 32, "logprob_mb_tokens": 32},
    }, "policy")
    engine = create_engine(policy)
    batch = random_token_batch(VOCAB, LENGTHS, seed=0)
    result = {}
    for ignore in (CPU_ONLY_READS, []):
        with HostReads([engine.model], ignore=ignore) as reads:
            step = engine.forward_backward(batch, ClippedPGLoss())
            engine.compute_logprobs(batch)
        engine.zero_grad()
        result["ignored" if ignore else "all"] = dict(reads.where)
    result["micro_batches"] = step.num_micro_batches
    return result


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_model_passes_read_nothing_on_the_host(engine: str) -> None:
    pytest.importorskip(f"engine_{engine}")
    ckpt = str(cached_tiny_checkpoint("qwen2"))
    result = run_distributed(_reads, world_size=1, args=(engine, ckpt))[0]
    assert result["micro_batches"] > 1, result
    # the instrument sees reads inside these passes: seqpack's CPU branch, when not ignored
    assert any("seqpack" in caller for caller in result["all"]), result["all"]
    assert result["ignored"] == {}, f"host reads inside the model's forward/backward: {result['ignored']}"
