"""Optimizer, learning-rate schedule and gradient clipping for sharded (DTensor) parameters.

Owns: building any `torch.optim` class by name from `policy.optimizer`, the warmup + constant/cosine/
linear schedule of `policy.scheduler`, and clipping by the total norm when parameters live on
different DeviceMeshes (TP params on the 2-D mesh, replicated ones on the dp mesh), where
`torch.nn.utils.clip_grad_norm_` fails ("All operands in aten.stack.default must have the same mesh").
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from rl_core.config import OptimizerConfig, SchedulerConfig


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """`torch.optim.<cfg.name>(params, **cfg.kwargs)`; an unknown name lists the closest class."""
    cls = getattr(torch.optim, cfg.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)]
        near = difflib.get_close_matches(cfg.name, names, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ValueError(f"policy.optimizer.name={cfg.name!r} is not a torch.optim optimizer{hint}")
    try:
        return cls(list(params), **cfg.kwargs)
    except TypeError as exc:
        raise ValueError(
            f"policy.optimizer.kwargs {cfg.kwargs} do not fit torch.optim.{cfg.name}: {exc}"
        ) from exc


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_factor)


def _mesh_key(grad: Tensor) -> object:
    return grad.device_mesh if isinstance(grad, DTensor) else None


@torch.no_grad()
def total_grad_norm(params: Iterable[nn.Parameter]) -> Tensor:
    """L2 norm of all gradients over every rank, grouping DTensor grads by mesh (float32 scalar)."""
    groups: dict[object, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(_mesh_key(p.grad), []).append(p.grad)
    squared = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # Partial over the mesh: full_tensor() all-reduces it
            norm = norm.full_tensor()
        squared = squared + norm.float().cpu() ** 2
    return squared.sqrt()


@torch.no_grad()
def clip_grads_(params: list[nn.Parameter], max_norm: float | None) -> float:
    """Clip to `max_norm` by the global total norm (if set); returns the norm before clipping."""
    norm = total_grad_norm(params)
    if max_norm is not None and math.isfinite(float(norm)):
        by_mesh: dict[object, list[nn.Parameter]] = {}
        for p in params:
            if p.grad is not None:
                by_mesh.setdefault(_mesh_key(p.grad), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].grad.device))
    return float(norm)
