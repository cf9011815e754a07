"""Megatron's optimizer and lr scheduler, built from the shared `policy.optimizer` / `policy.scheduler`.

Owns the mapping from the torch-style optimizer config (name + kwargs) to megatron's `OptimizerConfig`
(distributed optimizer by default), the `OptimizerParamScheduler` built from `policy.scheduler`, and the
step: clip by the global grad norm, skip the update when that norm is not finite. The semantics follow
torch: every parameter is weight-decayed (megatron would skip biases and norms by default), so that the
same `policy.optimizer` gives the same update in every engine.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from engine_megatron.config import MegatronConfig
from rl_core.config import ConfigError, PolicyConfig

logger = logging.getLogger(__name__)

# torch.optim name -> (megatron optimizer, its fixed settings); kwargs map below.
_OPTIMIZERS = {
    "AdamW": ("adam", {"decoupled_weight_decay": True}),
    "Adam": ("adam", {"decoupled_weight_decay": False}),
    "SGD": ("sgd", {}),
}
_KWARGS = {"lr": "lr", "weight_decay": "weight_decay", "eps": "adam_eps", "momentum": "sgd_momentum"}


def megatron_optimizer_config(policy: PolicyConfig, cfg: MegatronConfig) -> Any:
    """`policy.optimizer` (+ `policy.megatron_cfg.optimizer` overrides) as megatron's OptimizerConfig."""
    from megatron.core.optimizer import OptimizerConfig

    name = policy.optimizer.name
    if name not in _OPTIMIZERS:
        raise ConfigError(f"policy.optimizer.name={name!r} has no megatron equivalent; choose one of {sorted(_OPTIMIZERS)}")
    kind, fixed = _OPTIMIZERS[name]
    kwargs: dict[str, Any] = {"optimizer": kind, **fixed}
    for key, value in policy.optimizer.kwargs.items():
        if key == "betas":
            kwargs["adam_beta1"], kwargs["adam_beta2"] = (float(b) for b in value)
        elif key in _KWARGS:
            kwargs[_KWARGS[key]] = float(value)
        else:
            raise ConfigError(f"policy.optimizer.kwargs.{key} is not supported by the megatron engine; supported: "
                              f"{sorted([*_KWARGS, 'betas'])} (megatron-only settings go in policy.megatron_cfg.optimizer)")
    precision = policy.precision
    kwargs.update(
        clip_grad=float(policy.max_grad_norm or 0.0),
        use_distributed_optimizer=True,
        params_dtype=getattr(torch, precision),
        bf16=precision == "bfloat16",
        fp16=precision == "float16",
        min_lr=float(kwargs["lr"]) * policy.scheduler.min_lr_ratio,
    )
    kwargs.update(cfg.optimizer)
    return OptimizerConfig(**kwargs)


def build_optimizer(opt_config: Any, model_chunks: list) -> Any:
    from megatron.core.optimizer import get_megatron_optimizer

    # config_overrides={}: decay every parameter (torch semantics), see the module docstring.
    return get_megatron_optimizer(opt_config, model_chunks, config_overrides={})


def build_scheduler(optimizer: Any, policy: PolicyConfig, cfg: MegatronConfig) -> Any:
    """megatron's OptimizerParamScheduler; its lr follows `policy.scheduler` unless megatron_cfg.scheduler
    overrides any of its settings, in which case megatron's own schedule (lr_decay_style, WSD...) is used.

    Why not megatron's formula always: it warms up from step 0 with lr = init_lr (0), where policy.scheduler
    (and the DTensor engine) start at lr / warmup_steps; the same config must give the same lr sequence.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    sched = policy.scheduler
    lr = float(policy.optimizer.kwargs["lr"])
    wd = float(policy.optimizer.kwargs.get("weight_decay", 0.0 if policy.optimizer.name == "SGD" else 0.01))
    kwargs: dict[str, Any] = dict(
        init_lr=0.0 if sched.warmup_steps else lr, max_lr=lr, min_lr=lr * sched.min_lr_ratio,
        lr_warmup_steps=sched.warmup_steps, lr_decay_steps=max(sched.total_steps, sched.warmup_steps + 1),
        lr_decay_style=sched.decay, start_wd=wd, end_wd=wd, wd_incr_steps=max(sched.total_steps, 1),
        wd_incr_style="constant",
        # a resumed run follows its config (lr, weight decay, schedule), as the DTensor engine does; megatron's
        # default keeps the checkpoint's values, silently ignoring a changed policy.optimizer on resume
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )
    if cfg.scheduler:
        kwargs.update(cfg.scheduler)
        if kwargs["use_checkpoint_opt_param_scheduler"] and "override_opt_param_scheduler" not in cfg.scheduler:
            kwargs["override_opt_param_scheduler"] = False  # asked for megatron's own: megatron refuses both
        return OptimizerParamScheduler(optimizer, **kwargs)

    class PolicyScheduler(OptimizerParamScheduler):
        def get_lr(self, param_group: dict) -> float:
            return lr * sched.lr_factor(self.num_steps)

    return PolicyScheduler(optimizer, **kwargs)


def current_lr(optimizer: Any) -> float:
    groups = optimizer.param_groups
    return float(groups[0]["lr"]) if groups else 0.0


def optimizer_step(optimizer: Any, scheduler: Any, max_grad_norm: float | None) -> dict[str, float]:
    """Clip to max_grad_norm by the global norm, step, advance the scheduler; skip on a non-finite norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    lr = current_lr(optimizer)
    found_inf = optimizer.prepare_grads()  # copies the reduced grad buffers into the main grads
    grad_norm = float(optimizer.get_grad_norm())  # all-reduced over DP, TP, PP (and experts)
    if found_inf or not math.isfinite(grad_norm):
        logger.warning("skipping the optimizer step: grad norm %s is not finite", grad_norm)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0}
    if max_grad_norm:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            params = sub.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=max_grad_norm, total_norm=grad_norm)
    optimizer.step_with_ready_grads()
    scheduler.step(increment=1)
    return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0}
