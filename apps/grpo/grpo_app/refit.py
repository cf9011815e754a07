"""Weight refit: stream the policy's full HF-named tensors into the generators.

`refit_path` picks the path from the placement, before anything starts: a generator inside the policy
process (`generation.in_policy_workers`) takes the tensors as they stream out of `export_hf_weights`, an
in-process copy with no group; generation workers on their own GPUs receive them over NCCL, on CPU over
gloo. Colocated generation workers on a GPU would need two NCCL ranks on one device, which NCCL refuses
(`ncclInvalidUsage: Duplicate GPU detected`), so that layout is a config error.

Between processes, tensors travel over a dedicated torch.distributed group (gloo on CPU, NCCL on GPU) between policy
rank 0 (group rank 0) and every generation worker, never through Ray's object store. The group is a
standalone process group over its own TCPStore, so it does not disturb the policy's training group.
Each tensor is preceded by a small header (name, dtype, shape) so the receiver needs no side channel;
a header with name length -1 ends the stream. A receiver whose loader refuses a tensor (`receive_into`)
still reads the stream to its end, so the sender finishes instead of blocking until the group timeout.
"""

from __future__ import annotations

import datetime
import enum
import logging
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from rl_core.config import ConfigError

if TYPE_CHECKING:
    from grpo_app.config import GRPOConfig

logger = logging.getLogger(__name__)

MAX_NAME_BYTES = 512
MAX_DIMS = 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int8]


class RefitPath(enum.Enum):
    IN_PROCESS = "in-process copy"  # the generator lives in the policy rank
    NCCL = "NCCL group"  # generation workers on GPUs of their own
    GLOO = "gloo group"  # generation workers on CPU


def num_gpus_needed(cfg: GRPOConfig) -> int:
    """Policy ranks one GPU each; separate (non-colocated) generation workers one GPU each after them."""
    gen = cfg.generation
    return cfg.cluster.train_world_size + (0 if gen.in_policy_workers or gen.colocated else gen.num_workers)


def refit_path(cfg: GRPOConfig) -> RefitPath:
    """How weights reach the generators for this placement; a layout that cannot work is a ConfigError."""
    gen, cluster = cfg.generation, cfg.cluster
    if cluster.device == "cuda":
        have = cluster.gpus_per_node * cluster.num_nodes
        if num_gpus_needed(cfg) > have:
            raise ConfigError(
                f"the layout needs {num_gpus_needed(cfg)} GPUs (cluster.train_world_size={cluster.train_world_size}"
                + ("" if gen.in_policy_workers or gen.colocated else f" + generation.num_workers={gen.num_workers}")
                + f") but cluster.gpus_per_node x num_nodes = {have}: lower them, or set generation.colocated=true")
    if gen.in_policy_workers:
        return RefitPath.IN_PROCESS
    if cluster.device == "cpu":
        return RefitPath.GLOO
    if gen.colocated:
        raise ConfigError(
            "generation.colocated=true with generation.in_policy_workers=false on GPUs puts a generation worker and "
            "a policy rank on one GPU, and NCCL refuses two ranks on one device: set generation.in_policy_workers="
            "true (the generator lives in the policy process) or generation.colocated=false (generators on GPUs "
            "of their own)")
    tp = int(gen.backend_kwargs.get("tensor_parallel_size", 1))
    if tp > 1:  # vLLM would refuse it at start-up, in the actor: "World size (N) is larger than ... GPUs (1)"
        raise ConfigError(
            f"generation.backend_kwargs.tensor_parallel_size={tp} with generation.in_policy_workers=false on GPUs: "
            "each generation worker gets one GPU, so its vLLM cannot shard over several; set generation."
            "in_policy_workers=true (every tensor_parallel_size policy ranks hold one replica) or tensor_parallel_size"
            "=1 with more generation.num_workers")
    return RefitPath.NCCL


def refit_in_process(named_tensors: Iterable[tuple[str, Tensor]], backend: Any) -> int:
    """Hand the tensors to a generator in this process as they stream out of `export_hf_weights`, one at a
    time (never a full state-dict copy); returns the bytes handed over."""
    sent = 0

    def counted() -> Iterator[tuple[str, Tensor]]:
        nonlocal sent
        for name, tensor in named_tensors:
            sent += tensor.numel() * tensor.element_size()
            yield name, tensor

    backend.update_weights(counted())
    return sent


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """A TCPStore whose server listens on `host` only (torch's own binds every interface: a local run
    must not listen beyond 127.0.0.1)."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, master_listen_fd=listener.detach())


class RefitGroup:
    """One sender (rank 0) and `world_size - 1` receivers over a standalone gloo/NCCL group."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, device: str = "cpu",
                 timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = tcp_store(host, port, world_size, rank == 0, timeout)
        if device == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank, self.device = rank, torch.device(device)

    def _broadcast(self, tensor: Tensor) -> Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def send(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Broadcast every (name, tensor); returns the number of bytes sent."""
        total = 0
        for name, tensor in named_tensors:
            encoded = name.encode()
            if len(encoded) > MAX_NAME_BYTES or tensor.dim() > MAX_DIMS:
                raise ValueError(f"refit cannot send {name!r} with shape {tuple(tensor.shape)}: name or rank too long")
            header = torch.zeros(3 + MAX_DIMS, dtype=torch.int64)
            header[:3] = torch.tensor([len(encoded), DTYPES.index(tensor.dtype), tensor.dim()])
            header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
            name_buf = torch.zeros(MAX_NAME_BYTES, dtype=torch.uint8)
            name_buf[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
            self._broadcast(header.to(self.device))
            self._broadcast(name_buf.to(self.device))
            self._broadcast(tensor.detach().contiguous().to(self.device))
            total += tensor.numel() * tensor.element_size()
        end = torch.zeros(3 + MAX_DIMS, dtype=torch.int64)
        end[0] = -1
        self._broadcast(end.to(self.device))
        return total

    def receive(self) -> Iterator[tuple[str, Tensor]]:
        """Yield (name, tensor) pairs as they arrive, until the sender's end marker."""
        while True:
            header = self._broadcast(torch.zeros(3 + MAX_DIMS, dtype=torch.int64, device=self.device)).cpu()
            name_len, dtype_code, ndim = (int(x) for x in header[:3])
            if name_len < 0:
                return
            name_buf = self._broadcast(torch.zeros(MAX_NAME_BYTES, dtype=torch.uint8, device=self.device)).cpu()
            name = bytes(name_buf[:name_len].tolist()).decode()
            shape = [int(x) for x in header[3 : 3 + ndim]]
            yield name, self._broadcast(torch.empty(shape, dtype=DTYPES[dtype_code], device=self.device))

    def receive_into(self, load: Callable[[Iterator[tuple[str, Tensor]]], Any]) -> None:
        """`load(self.receive())` (e.g. a backend's `update_weights`); if `load` raises (a refused name or
        shape) or stops early, the rest of the stream is still read and dropped before the error propagates:
        the sender's broadcasts only complete once every receiver takes part."""
        stream = self.receive()
        try:
            load(stream)
        finally:
            for _ in stream:  # a no-op once the stream ended (or itself failed)
                pass
