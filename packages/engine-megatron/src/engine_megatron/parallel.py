"""Process groups: megatron's `parallel_state` on top of the default group (rl_core.distributed joins it).

Owns (re)initialising megatron's model-parallel groups from `policy.megatron_cfg`, and the model-parallel
RNG seeds. Does not touch the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_megatron.config import MegatronConfig


@dataclass(frozen=True)
class ParallelRanks:
    """This rank's coordinates in megatron's process grid."""

    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def init_model_parallel(cfg: MegatronConfig) -> ParallelRanks:
    """(Re)build megatron's process groups for this config and seed the model-parallel RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # one engine per process at a time: its layout wins
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.etp,
    )
    # Same seed on every rank: data-parallel replicas must build identical weights; megatron offsets the
    # tensor-parallel stream by the TP rank itself.
    torch.manual_seed(cfg.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    return current_ranks()


def current_ranks() -> ParallelRanks:
    from megatron.core import parallel_state as ps

    return ParallelRanks(
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(), cp_size=ps.get_context_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
    )


def broadcast_from_last_stage(obj: object, ranks: ParallelRanks) -> object:
    """Send a picklable object from the last pipeline stage to every stage of this pipeline."""
    if ranks.pp_size == 1:
        return obj
    from megatron.core import parallel_state as ps

    box = [obj if ranks.last_stage else None]
    dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]
