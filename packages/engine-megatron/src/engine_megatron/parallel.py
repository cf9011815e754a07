"""Process groups: the default torch.distributed group and megatron's `parallel_state`.

Owns starting a one-rank gloo group when the caller has none, (re)initialising megatron's model-parallel
groups from `policy.megatron_cfg`, and the model-parallel RNG seeds. Does not touch the model.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_megatron.config import MegatronConfig

logger = logging.getLogger(__name__)


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_process_group(use_cuda: bool) -> int:
    """The world size of the default group, starting a one-rank group if there is none."""
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        logger.info("no torch.distributed group: starting a 1-rank %s group", backend)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    return dist.get_world_size()


def init_model_parallel(cfg: MegatronConfig, use_cuda: bool) -> ParallelRanks:
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
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
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
