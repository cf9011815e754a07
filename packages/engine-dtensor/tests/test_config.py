"""Config validation, parallel dims, optimizer lookup and the LR schedule (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_dtensor.config import DTensorConfig
from engine_dtensor.optim import build_optimizer, build_scheduler
from engine_dtensor.parallel_dims import ParallelDims
from engine_dtensor.testing import make_policy
from rl_core.config import ConfigError, SchedulerConfig


def test_unknown_key_names_the_closest() -> None:
    policy = make_policy("/nowhere", dtensor_cfg={"enabled": True, "tensor_paralel_size": 2})
    with pytest.raises(
        ConfigError,
        match=r"policy\.dtensor_cfg\.tensor_paralel_size.*did you mean 'policy\.dtensor_cfg\.tensor_parallel_size'",
    ):
        DTensorConfig.from_policy(policy)
    # the same typo under policy.engine_cfg (engine chosen by policy.engine) names that section
    policy = make_policy("/nowhere", engine="dtensor", engine_cfg={"tensor_paralel_size": 2})
    with pytest.raises(ConfigError, match=r"'policy\.engine_cfg\.tensor_paralel_size'.*policy\.engine_cfg\.tensor_parallel_size"):
        DTensorConfig.from_policy(policy)


def test_precision_resolution_and_cross_field_checks() -> None:
    assert DTensorConfig.from_policy(make_policy("/x", precision="bfloat16")).precision == "bfloat16"
    cfg = DTensorConfig.from_policy(
        make_policy("/x", precision="bfloat16", dtensor_cfg={"precision": "float32"})
    )
    assert cfg.precision == "float32"
    with pytest.raises(ConfigError, match="bfloat16"):
        DTensorConfig.from_policy(make_policy("/x", precision="float16"))
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        DTensorConfig.from_policy(make_policy("/x", dtensor_cfg={"sequence_parallel": True}))
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        DTensorConfig.from_policy(make_policy("/x", dtensor_cfg={"tensor_parallel_size": 0}))


def test_parallel_dims_product_must_equal_world() -> None:
    dims = ParallelDims.from_world(4, 2)
    assert (dims.dp, dims.tp, dims.tp_enabled) == (2, 2, True)
    with pytest.raises(ValueError, match=r"dp\(2\) \* tp\(2\) != WORLD_SIZE\(3\)"):
        ParallelDims(dp=2, tp=2, world_size=3)
    with pytest.raises(ValueError, match="does not divide"):
        ParallelDims.from_world(3, 2)


def test_optimizer_by_name() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    policy = make_policy("/x", optimizer={"name": "SGD", "kwargs": {"lr": 0.5, "momentum": 0.9}})
    opt = build_optimizer(params, policy.optimizer)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="did you mean 'AdamW'"):
        build_optimizer(
            params, make_policy("/x", optimizer={"name": "AdamWW", "kwargs": {"lr": 1.0}}).optimizer
        )
    with pytest.raises(ValueError, match="do not fit torch.optim.SGD"):
        build_optimizer(
            params, make_policy("/x", optimizer={"name": "SGD", "kwargs": {"lr": 1.0, "betas": 1}}).optimizer
        )


@pytest.mark.parametrize("decay", ["constant", "cosine", "linear"])
def test_lr_schedule_against_closed_form(decay: str) -> None:
    cfg = SchedulerConfig(warmup_steps=4, decay=decay, total_steps=14, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(16):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    warm = [2.0 * (k + 1) / 4 for k in range(4)]
    progress = [min(1.0, k / 10) for k in range(12)]
    if decay == "constant":
        tail = [2.0] * 12
    elif decay == "cosine":
        tail = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))) for p in progress]
    else:
        tail = [2.0 * (0.1 + 0.9 * (1 - p)) for p in progress]
    assert seen == pytest.approx(warm + tail, abs=1e-12)
    assert cfg.lr_factor(100) == pytest.approx(1.0 if decay == "constant" else 0.1)
