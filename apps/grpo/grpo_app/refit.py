"""Weight refit: stream the policy's full HF-named tensors into the generators.

`refit_path` picks the path from the placement, before anything starts: a generator inside the policy
process (`generation.in_policy_workers`) takes the tensors as they stream out of `export_hf_weights`, an
in-process copy with no group; generation workers on their own GPUs receive them over NCCL, on CPU over
gloo. Colocated generation workers on a GPU would need two NCCL ranks on one device, which NCCL refuses
(`ncclInvalidUsage: Duplicate GPU detected`), so that layout is a config error.

Between processes, tensors travel over a dedicated torch.distributed group (gloo on CPU, NCCL on GPU) between policy
rank 0 (group rank 0) and every generation worker, never through Ray's object store. The group is a
standalone process group over its own TCPStore, so it does not disturb the policy's training group.
Tensors travel in buckets, each preceded by its size and its tensors' names, dtypes and shapes, so the receiver
needs no side channel; a size of -1 ends the stream. A receiver whose loader refuses a tensor (`receive_into`)
still reads the stream to its end, so the sender finishes instead of blocking until the group timeout.
"""

from __future__ import annotations

import datetime
import enum
import json
import logging
import math
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

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.int8]
# Tensors go over in buckets of at most this many bytes: three broadcasts a bucket (its size, its tensors' names /
# dtypes / shapes, their bytes), not three a tensor (82 a step for the CPU default, ~870 for a 0.5B model); one
# bucket buffer is the only extra memory on each side.
BUCKET_BYTES = 256 * 2**20
ALIGN = 16  # every tensor starts at a multiple of this in its bucket, so its bytes view as any dtype


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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


STORE_TIMEOUT = datetime.timedelta(minutes=10)


def tcp_store(host: str, port: int, world_size: int, is_master: bool,
              timeout: datetime.timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A group's TCPStore. The master's server listens on `host` only (torch's own binds every interface: a
    local run must not listen beyond 127.0.0.1), on `port`, or with port 0 on one the OS picks as it binds
    (`store.port`): a port found free ahead and bound later can be taken in between ("Address already in use",
    seen in CI with two test processes). The master does not wait for the others, so it can be opened first
    and its port sent to them; the group they form waits for every rank."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


class RefitGroup:
    """One sender (rank 0) and `world_size - 1` receivers over a standalone gloo/NCCL group on `store`
    (`tcp_store`: the sender's, the others' connected to it)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, *, device: str = "cpu",
                 timeout_s: float = 600.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if device == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank, self.device = rank, torch.device(device)

    def _broadcast(self, tensor: Tensor) -> Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int = BUCKET_BYTES) -> int:
        """Broadcast every (name, tensor), in buckets of at most `bucket_bytes`; returns the number of bytes sent.

        Each tensor is copied into one reused bucket buffer as it arrives and then let go, so the sender holds the
        buffer plus one tensor (a DTensor's freshly gathered full tensor): holding a bucket's tensors until it was
        sent doubled that (a 7B model's bucket with lm_head: 1.3 GiB of sources beside a 1.3 GiB copy). A tensor
        larger than a bucket goes alone, as its own bytes, with no copy."""
        total, entries, offset, buffer = 0, [], 0, None
        for name, tensor in named_tensors:
            if tensor.dtype not in DTYPES:
                raise ValueError(f"refit cannot send {name!r} of dtype {tensor.dtype}; it sends {DTYPES}")
            nbytes = tensor.numel() * tensor.element_size()
            total += nbytes
            entry = [name, DTYPES.index(tensor.dtype), list(tensor.shape)]
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            del tensor  # only `data` (its bytes) is held from here; let go of it before the next tensor is made
            alone = nbytes >= bucket_bytes
            if entries and (alone or offset + nbytes > bucket_bytes):  # send what the bucket holds first
                self._send_bucket(entries, buffer[:offset])
                entries, offset = [], 0
            if alone:
                self._send_bucket([entry], data)
            else:
                if buffer is None:  # ALIGN's padding after the last entry fits too
                    buffer = torch.empty(_aligned(bucket_bytes), dtype=torch.uint8, device=self.device)
                buffer[offset : offset + nbytes] = data
                entries.append(entry)
                offset = _aligned(offset + nbytes)
            del data
        if entries:
            self._send_bucket(entries, buffer[:offset])
        self._broadcast(torch.tensor([-1, 0], dtype=torch.int64, device=self.device))  # the end marker
        return total

    def _send_bucket(self, entries: list[list], payload: Tensor) -> None:
        """Three broadcasts: the sizes, the entries' (name, dtype, shape) as JSON, the bytes (each entry at a
        multiple of ALIGN)."""
        meta = json.dumps(entries).encode()
        self._broadcast(torch.tensor([len(meta), payload.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device))
        self._broadcast(payload if payload.device == self.device else payload.to(self.device))

    def receive(self) -> Iterator[tuple[str, Tensor]]:
        """Yield (name, tensor) pairs as they arrive, until the sender's end marker; the tensors of one bucket are
        views of its buffer."""
        while True:
            meta_len, size = (int(x) for x in self._broadcast(torch.zeros(2, dtype=torch.int64,
                                                                          device=self.device)).cpu())
            if meta_len < 0:
                return
            meta = self._broadcast(torch.empty(meta_len, dtype=torch.uint8, device=self.device)).cpu()
            payload = self._broadcast(torch.empty(size, dtype=torch.uint8, device=self.device))
            offset = 0
            for name, dtype_code, shape in json.loads(bytes(meta.tolist())):
                dtype = DTYPES[dtype_code]
                nbytes = math.prod(shape) * dtype.itemsize
                yield name, payload[offset : offset + nbytes].view(dtype).view(shape)
                offset += _aligned(nbytes)

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
            if self.device.type == "cuda":  # the buckets' buffers go back to the driver: vLLM's memory budget,
                torch.cuda.empty_cache()  # sized at its start, does not count torch's cache
