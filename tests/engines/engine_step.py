"""One `train_batch` of a registered engine on a fixed global batch, as a user's script would run it.

`python engine_step.py ENGINE CKPT OUT` alone trains on one rank; under `torchrun --nproc_per_node N`
each rank takes its DP shard of the same global batch. Rank 0 saves the updated HF weights to OUT.
`train_one_step` is also imported by the tests, to run the reference inside an existing group.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from rl_core.config import PolicyConfig, parse_config
from rl_core.losses import ClippedPGLoss
from rl_core.registry import create_engine
from rl_core.testing.contracts import random_token_batch

LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6]
# AdamW eps 1e-4: Adam's first step moves a weight by lr * g / (|g| + eps), which turns float-noise gradients
# (|g| ~ 1e-9, summed in another order on two ranks) into lr-sized updates of random sign with torch's 1e-8
# (see engine-megatron's parity test), and with 1e-6 still put megatron's 2 ranks 2.7e-6 from 1 rank on an AVX2
# machine; a gradient of 1e-2 still moves its weight by ~lr.
POLICY = {"precision": "float32", "train_micro_batch_size": 2, "logprob_batch_size": 4, "max_grad_norm": 1.0,
          "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.01, "eps": 1e-4}}}


def train_one_step(engine_name: str, ckpt: str, vocab_size: int) -> dict:
    """dp_size, loss and the updated HF-named weights (on every rank: export is collective)."""
    policy = parse_config(PolicyConfig, {**POLICY, "model_name": ckpt, "engine": engine_name}, "policy")
    engine = create_engine(policy)
    batch = random_token_batch(vocab_size, LENGTHS, seed=0)
    mine = batch.select(list(range(engine.dp_rank, len(batch), engine.dp_size)))
    metrics = engine.train_batch(mine, ClippedPGLoss())
    weights = {name: tensor.detach().cpu().clone() for name, tensor in engine.export_hf_weights()}
    return {"dp_size": engine.dp_size, "world_size": dist.get_world_size(), "loss": metrics["loss"],
            "weights": weights}


if __name__ == "__main__":
    engine_name, ckpt, out = sys.argv[1:4]
    torch.set_num_threads(1)
    result = train_one_step(engine_name, ckpt, int(sys.argv[4]) if len(sys.argv) > 4 else 128)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.destroy_process_group()
