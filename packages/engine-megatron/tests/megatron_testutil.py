"""Helpers shared by the engine-megatron tests (a module: conftest is not importable in importlib mode).

`engine_run` is what every multi-rank test runs inside `run_distributed`: build a MegatronEngine from a
tiny HF checkpoint, compute logprobs of this rank's DP shard of one fixed global batch, train, export.
Results carry the global sequence indices so that runs with different layouts can be compared.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from rl_core.batch import TokenBatch
from rl_core.config import PolicyConfig, parse_config
from rl_core.losses import ClippedPGLoss, LossConfig
from rl_core.testing.contracts import random_token_batch

VOCAB = 100  # tiny checkpoints with vocab 100: megatron pads to 128 * TP, so padding is exercised
LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6]
LOSS = LossConfig(eps_low=0.2, eps_high=0.28, agg="token-mean")

POLICY = {
    "precision": "float32",
    "train_micro_batch_size": 2,
    "logprob_batch_size": 3,
    "max_grad_norm": 1.0,
    "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8}},
    "scheduler": {"warmup_steps": 0, "decay": "constant"},
}


def make_policy(ckpt: str, megatron_cfg: dict[str, Any] | None = None, **overrides: Any) -> PolicyConfig:
    raw = copy.deepcopy(POLICY)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    raw.update(model_name=ckpt, megatron_cfg={"enabled": True, **(megatron_cfg or {})})
    return parse_config(PolicyConfig, raw, "policy")


def global_batch(seed: int = 0, lengths: list[int] | None = None) -> TokenBatch:
    return random_token_batch(VOCAB, lengths or LENGTHS, seed=seed)


def dp_indices(n: int, dp_rank: int, dp_size: int) -> list[int]:
    return list(range(dp_rank, n, dp_size))


def engine_run(rank: int, world_size: int, ckpt: str, megatron_cfg: dict[str, Any], policy_kw: dict[str, Any],
               steps: int = 1, export: bool = True, seed: int = 0) -> dict[str, Any]:
    """Build, logprobs, `steps` x train_batch, logprobs again, export; per-rank results by global index."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, megatron_cfg, **policy_kw))
    batch = global_batch(seed)
    indices = dp_indices(len(batch), engine.dp_rank, engine.dp_size)
    mine = batch.select(indices)
    before = engine.compute_logprobs(mine)
    mine = mine.with_fields(prev_logprobs=[lp.clone() for lp in before])
    loss = ClippedPGLoss(LOSS)
    metrics = [engine.train_batch(mine, loss) for _ in range(steps)]
    after = engine.compute_logprobs(mine)
    weights = None
    if export:
        exported = {name: tensor.clone() for name, tensor in engine.export_hf_weights()}
        weights = exported if rank == 0 else sorted(exported)
    return {"indices": indices, "before": before, "after": after, "metrics": metrics, "weights": weights}


def by_index(results: list[dict[str, Any]], key: str) -> dict[int, torch.Tensor]:
    out = {}
    for res in results:
        out.update(zip(res["indices"], res[key]))
    return out


def max_abs_diff(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||b|| (float64)."""
    assert sorted(a) == sorted(b), f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in a)


def hf_target_logprobs(ckpt: str, batch: TokenBatch, temperature: float = 1.0) -> list[torch.Tensor]:
    """Independent reference: the HF model, one sequence at a time, fp64 log-softmax of fp32 logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in batch.input_ids:
            logits = model(ids[None]).logits[0].double() / temperature  # (L, V)
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1, dtype=torch.float64), lp]).float())
    return out
