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


_ON_DEVICE = {"sum": torch.sum, "min": torch.amin, "max": torch.amax}
_ON_HOST = {"sum": sum, "min": min, "max": max}


def combine_metrics(parts: Iterable[Mapping[str, Tensor | float]]) -> dict[str, float]:
    """Reduce a list of micro-batch metric dicts into one, by the key's rule.

    Tensor values are reduced where they live and read back together, one host read per device: a read
    per value waits for the GPU each time (a loss's ~8 metrics per micro-batch)."""
    by_key: dict[str, list[Tensor | float]] = {}
    for part in parts:
        for key, value in part.items():
            by_key.setdefault(key, []).append(value)
    host: dict[str, list[float]] = {}
    on_device: dict[torch.device, list[tuple[str, Tensor]]] = {}
    for key, values in by_key.items():
        tensors = [v.detach().reshape(()).double() for v in values if torch.is_tensor(v)]
        host[key] = [float(v) for v in values if not torch.is_tensor(v)]
        if tensors and len({t.device for t in tensors}) == 1:
            on_device.setdefault(tensors[0].device, []).append((key, _ON_DEVICE[_reduce_op(key)](torch.stack(tensors))))
        else:  # tensors spread over devices (not seen in the engines): read one by one
            host[key] += [float(t) for t in tensors]
    for reduced in on_device.values():
        for (key, _), value in zip(reduced, torch.stack([t for _, t in reduced]).tolist()):
            host[key].append(value)
    return {key: _ON_HOST[_reduce_op(key)](values) for key, values in host.items()}


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
