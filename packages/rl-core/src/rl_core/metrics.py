"""Reduction of per-micro-batch metrics into per-step metrics.

One rule for every engine: a loss returns each metric already divided by the *global* normaliser
(tokens or sequences of the whole global batch), so metrics are summed over micro-batches and DP
ranks. Keys ending in `_min` or `_max` are reduced with min / max instead.

Over the optimizer steps of one GRPO step (`combine_optimizer_steps`) the means (losses, fractions, grad norm,
lr) are averaged, the counts in `COUNT_KEYS` add up and `_min` / `_max` keys stay extremes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _reduce_op(key: str) -> str:
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    return "sum"


def combine_metrics(parts: Iterable[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Reduce a list of micro-batch metric dicts into one, by the key's rule."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            value = float(value)
            if key not in out:
                out[key] = value
                continue
            op = _reduce_op(key)
            out[key] = min(out[key], value) if op == "min" else max(out[key], value) if op == "max" else out[key] + value
    return out


# Metrics that count things (tokens, micro-batches, skipped optimizer steps): summed over optimizer steps.
COUNT_KEYS = frozenset({"nonfinite_logprob_tokens", "num_micro_batches", "skipped"})


def combine_optimizer_steps(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One GRPO step's metrics from those of its optimizer steps (each already reduced over micro-batches
    and DP ranks by `combine_metrics` / `all_reduce_metrics`)."""
    out: dict[str, float] = {}
    for key in steps[0]:
        values = [float(step[key]) for step in steps]
        op = _reduce_op(key)
        if op != "sum":
            out[key] = min(values) if op == "min" else max(values)
        else:
            out[key] = sum(values) if key in COUNT_KEYS else sum(values) / len(values)
    return out


def all_reduce_metrics(metrics: Mapping[str, float], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Reduce a metric dict over the ranks of `group` (no-op outside torch.distributed)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(metrics)
    keys = sorted(metrics)
    # NCCL reduces only device tensors; gloo only host tensors.
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    out = {}
    for op_name, op in (("sum", dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        chosen = [k for k in keys if _reduce_op(k) == op_name]
        if not chosen:
            continue
        values = torch.tensor([metrics[k] for k in chosen], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=op, group=group)
        out.update(zip(chosen, values.tolist()))
    return out
