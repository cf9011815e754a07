"""The MoE router's auxiliary losses of one training step, as metrics.

megatron's routers add the load-balancing loss (`moe_aux_loss_coeff`) and the z-loss (`moe_z_loss_coeff`) to the
gradient and record each, divided by its coefficient, in a process-wide tracker: per layer, summed over the
micro-batches of the step. `train/loss` is the policy loss alone; these are reported beside it, as megatron's own
training loop reports them (mean over MoE layers and micro-batches), averaged over all ranks.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from rl_core.metrics import all_reduce_metrics


def clear_router_losses() -> None:
    """Zero the tracker, so a step reports only its own micro-batches."""
    tracker = _tracker()
    if tracker is None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
    else:
        tracker.clear()


def router_losses(transformer_config: Any, num_micro_batches: int) -> dict[str, float]:
    """{"moe/<name>": value} for each router loss recorded since `clear_router_losses`, e.g.
    "moe/load_balancing_loss"; {} when the model routes no loss (coefficients 0). Every rank calls it (the sync is a
    collective on the ranks that recorded one, which with every layer an MoE layer is all of them)."""
    totals: dict[str, Any] = {}
    args = {"num_layers": transformer_config.num_layers, "moe_layer_freq": transformer_config.moe_layer_freq,
            "total_loss_dict": totals}
    tracker = _tracker()
    if tracker is None:  # megatron-core < 0.17: the function the tracker's `report` replaced
        from megatron.core.transformer.moe.moe_utils import (
            get_moe_layer_wise_logging_tracker,
            track_moe_metrics,
        )

        if not get_moe_layer_wise_logging_tracker():
            return {}
        track_moe_metrics(1.0 / num_micro_batches, 0, **args)
    else:
        if not tracker.metrics:
            return {}
        tracker.report(1.0 / num_micro_batches, 0, **args)
    # megatron-core 0.16 leaves the z-loss rank-local (no DP average) while it syncs the load-balancing loss over
    # all ranks: the mean over all ranks keeps a synced value and averages the token shards of one it left local
    world = dist.get_world_size() if dist.is_initialized() else 1
    return all_reduce_metrics({f"moe/{name}": float(value) / world for name, value in totals.items()})


def _tracker() -> Any:
    try:  # megatron-core >= 0.17
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        return None
    return get_moe_metrics_tracker()
