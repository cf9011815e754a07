"""Process-group bootstrap shared by every engine.

Owns one decision: which torch.distributed group an engine trains in. In order: the default group
that already exists (the trainer's workers, a test harness, a user who called init_process_group);
the launcher's environment (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: join it with
env://, so the ranks really train together); otherwise a one-rank group on a private store. Does not
build meshes or model-parallel groups (each engine does that on top of the default group).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def process_group_backend(use_cuda: bool) -> str:
    """gloo for CPU tensors beside NCCL for CUDA ones: engines reduce small host-side counts (token and
    sequence totals) on the default group and on the model-parallel groups megatron derives from it, and
    NCCL alone raises "No backend type associated with device type cpu"."""
    return "cpu:gloo,cuda:nccl" if use_cuda else "gloo"


def _let_collective_threads_finish() -> None:
    """At exit, before the interpreter stops running threads: free the engine's tensors and give up the GIL.

    gloo's worker threads drop a finished collective after the caller has already moved on, and dropping a
    tensor that Python created takes the GIL. A script that exits right after its last collective (an export,
    a checkpoint) can reach interpreter shutdown first; the worker then cannot take the GIL and the rank dies
    with "terminate called without an active exception" (SIGABRT, about one torchrun exit in ten on two busy
    cores; pytorch/pytorch#179291). Destroying the process group does not stop it: the engine's meshes still
    hold the group, so its worker threads live until the last garbage collection.
    """
    gc.collect()
    time.sleep(0.2)


def init_process_group(use_cuda: bool) -> torch.device:
    """Join (or start) the default process group as described in the module docstring; pick the device.

    On CUDA each rank uses GPU LOCAL_RANK (torchrun sets it), else rank modulo the visible GPUs.
    """
    atexit.unregister(_let_collective_threads_finish)  # once per process, however many engines it builds
    atexit.register(_let_collective_threads_finish)
    if not dist.is_initialized():
        backend = process_group_backend(use_cuda)
        present = [key for key in LAUNCHER_ENV if key in os.environ]
        if len(present) == len(LAUNCHER_ENV):
            dist.init_process_group(backend, init_method="env://")
            logger.info("joined the launcher's process group: rank %d of %d (%s)",
                        dist.get_rank(), dist.get_world_size(), backend)
        else:
            if present:  # half a launcher environment: say why we do not join it
                logger.warning("found %s but not all of %s: starting a 1-rank group instead", present, LAUNCHER_ENV)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            logger.info("no process group and no launcher: started a 1-rank %s group", backend)
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
