"""Reduction of per-micro-batch metrics into per-step metrics.

One rule for every engine: a loss returns each metric already divided by the *global* normaliser
(tokens or sequences of the whole global batch), so metrics are summed over micro-batches and DP
ranks. Keys ending in `_min` or `_max` are reduced with min / max instead.

Over the optimizer steps of one GRPO step (`combine_optimizer_steps`) the means (losses, fractions, grad norm,
lr) are averaged, the counts in `COUNT_KEYS` add up and `_min` / `_max` keys stay extremes; `grad_norm` is
averaged over the optimizer steps that were applied only (a skipped step's is NaN / inf).
"""

from __future__ import annotations

import math
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
COUNT_KEYS = frozenset({"loss_tokens", "nonfinite_logprob_tokens", "num_micro_batches", "skipped"})


def _applied(step: Mapping[str, float]) -> bool:
    """Whether the optimizer step was applied: not flagged `skipped` and with a finite grad norm."""
    return not float(step.get("skipped", 0.0)) and math.isfinite(float(step.get("grad_norm", 0.0)))


def combine_optimizer_steps(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One GRPO step's metrics from those of its optimizer steps (each already reduced over micro-batches
    and DP ranks by `combine_metrics` / `all_reduce_metrics`).

    Means are averaged over the steps, counts (`COUNT_KEYS`, e.g. `skipped`) summed, `_min` / `_max` keys
    keep the extreme. `grad_norm` is the mean over the *applied* optimizer steps only: a step the engine
    skipped (`skipped` > 0, its grad norm NaN / inf) changed no weight, and averaging its norm in would
    make the whole GRPO step's grad norm NaN although the other steps were fine. It is NaN only when
    every step was skipped; how many were is the `skipped` count. The other metrics of a skipped step
    (e.g. its NaN loss, `nonfinite_logprob_tokens`) are kept: they describe the batch, which was seen.

    An optimizer step without a loss token (`loss_tokens` 0: every completion of its mini-batch cut off under
    overlong filtering) trained on nothing: its per-token means are NaN and its loss and grad norm 0, so it is left
    out of the means (a step with loss tokens would otherwise log null and half its loss). Only when no step has a
    loss token are the means NaN, as the steps' own."""
    out: dict[str, float] = {}
    with_tokens = [step for step in steps if float(step.get("loss_tokens", 1.0)) > 0] or list(steps)
    applied = [step for step in with_tokens if _applied(step)]
    for key in steps[0]:
        values = [float(step[key]) for step in steps]
        op = _reduce_op(key)
        if key == "grad_norm":
            kept = [float(step[key]) for step in applied]
            out[key] = sum(kept) / len(kept) if kept else math.nan
        elif op != "sum":
            out[key] = min(values) if op == "min" else max(values)
        elif key in COUNT_KEYS:
            out[key] = sum(values)
        else:
            out[key] = sum(float(step[key]) for step in with_tokens) / len(with_tokens)
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
