"""Ray actors that host the engines: policy ranks and generation workers (the reward worker: grpo_app.reward_worker).

With `generation.in_policy_workers` the policy ranks host the generation backends too (`GeneratorHost`).

Actors only wrap the packages' objects and move data; no algorithm code lives here. Each policy rank
joins the training process group (gloo on CPU, NCCL on GPU) and builds its engine through the registry;
refit tensors move over a separate `RefitGroup`, not Ray's object store.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import ray
import torch

from grpo_app.refit import RefitGroup, refit_in_process, tcp_store
from grpo_app.worker_logging import setup_worker_logging

logger = logging.getLogger(__name__)


def join_policy_group(rank: int, world_size: int, store: Any) -> None:
    """The policy ranks' default process group on `store` (`tcp_store`), with the backend the engines expect
    (rl_core.distributed)."""
    import torch.distributed as dist

    from rl_core.distributed import process_group_backend

    dist.init_process_group(process_group_backend(torch.cuda.is_available()), store=store, rank=rank,
                            world_size=world_size)


def peak_gpu_memory() -> dict[str, float]:
    """`gpu_allocated_gib_max`: the largest `torch.cuda.max_memory_allocated` so far (training, and generation
    when in-process) over the policy ranks. A collective on their group: every rank's `train` reaches it. The
    loop keeps one rank's metrics, and with uneven DP shards another rank's peak can be the higher one."""
    from rl_core.metrics import all_reduce_metrics

    return all_reduce_metrics({"gpu_allocated_gib_max": torch.cuda.max_memory_allocated() / 2**30})


def _setup_process(num_threads: int) -> None:
    setup_worker_logging()
    torch.set_num_threads(max(1, num_threads))


class GeneratorHost:
    """What a process hosting a `GenerationBackend` offers the loop (generation actors, hybrid policy ranks)."""

    backend: Any = None

    def attach_generator(self, backend: str, model_path: str, backend_kwargs: dict[str, Any]) -> None:
        from rl_core.registry import create_generation_backend

        if backend_kwargs.get("distributed_executor_backend") == "external_launcher":
            # vLLM inside a policy rank: its engine core must run in this process (no engine subprocess), on
            # the rank's torch.distributed world (RANK/WORLD_SIZE/LOCAL_RANK are already set)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif int(backend_kwargs.get("tensor_parallel_size", 1)) == 1:
            # vLLM on this worker's one device: its engine core in this process too, so a refit hands the tensors
            # it receives straight to the model (rollout.vllm_backend), not a host copy of every weight through a
            # file in /dev/shm each step (a container's /dev/shm is often 64 MB). An exported variable still wins.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

        self.backend = create_generation_backend(backend, model_path=model_path, **backend_kwargs)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: Any) -> list[Any]:
        return self.backend.generate(prompt_token_ids, params)

    def sleep(self) -> None:
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()


@ray.remote
class PolicyWorker(GeneratorHost):
    """One training rank: a `TrainingEngine` (with a KL penalty, also the reference policy: a weights-only
    copy inside the engine when it implements `ReferencePolicy`, else a second engine); with
    `generation.in_policy_workers`, also a generation backend that refits by an in-process copy."""

    def __init__(self, policy: Any, rank: int, world_size: int, *, with_reference: bool, num_threads: int = 1) -> None:
        _setup_process(num_threads)
        self.policy, self.rank, self.world_size, self.with_reference = policy, rank, world_size, with_reference
        self.store: Any = None  # rank 0's: the store of the group it joins next (open_store)
        self.reference = None
        self.refit: RefitGroup | None = None

    def open_store(self, host: str, world_size: int) -> int:
        """Rank 0 hosts each group's store: opened here on a port the OS picks, which the driver hands to the
        other members; the next `start` or `join_refit` forms the group on it."""
        self.store = tcp_store(host, 0, world_size, True)
        return self.store.port

    def _take_store(self) -> Any:
        store, self.store = self.store, None
        return store

    def start(self, host: str, port: int) -> tuple[int, int]:
        """Join the training group (its store at host:port) and build the engine(s); returns (dp_rank, dp_size)."""
        from rl_core.interfaces import ReferencePolicy
        from rl_core.registry import create_engine

        os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        store = self._take_store() if self.rank == 0 else tcp_store(host, port, self.world_size, False)
        join_policy_group(self.rank, self.world_size, store)
        self.engine = create_engine(self.policy)
        # Taken before any checkpoint is loaded: on resume the reference is still the initial model.
        if self.with_reference and isinstance(self.engine, ReferencePolicy):
            self.engine.snapshot_reference()
        elif self.with_reference:  # an engine without the weights-only reference: a second, frozen engine
            self.reference = create_engine(self.policy)
        return self.engine.dp_rank, self.engine.dp_size

    def compute_logprobs(self, batch: Any, reference: bool = False) -> torch.Tensor:
        """This rank's sequences' logprobs concatenated (one tensor to pickle back, not one per sequence)."""
        if not reference:
            return torch.cat(self.engine.compute_logprobs(batch))
        if self.reference is None:
            return torch.cat(self.engine.compute_ref_logprobs(batch))
        return torch.cat(self.reference.compute_logprobs(batch))

    def train(self, batch: Any, loss_fn: Any) -> dict[str, float]:
        metrics = self.engine.train_batch(batch, loss_fn)
        if torch.cuda.is_available():
            metrics.update(peak_gpu_memory())
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.engine.save_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.engine.save_hf(path)

    def load_checkpoint(self, path: str) -> None:
        self.engine.load_checkpoint(path)

    def offload(self, keep_weights: bool = False) -> None:
        self.engine.offload(keep_weights=keep_weights)

    def onload(self) -> None:
        self.engine.onload()

    def join_refit(self, world_size: int, device: str) -> None:
        """Rank 0 sends to the generation workers, on the store it opened (open_store); the other ranks stay out."""
        if self.rank == 0:
            self.refit = RefitGroup(self._take_store(), 0, world_size, device=device)

    def refit_in_process(self) -> int:
        """Every rank gathers the full tensors (collective) and streams them into its own generator."""
        return refit_in_process(self.engine.export_hf_weights(), self.backend)

    def send_weights(self) -> int:
        """Every rank takes part in gathering full tensors; rank 0 broadcasts them to the generators."""
        weights = self.engine.export_hf_weights()
        if self.refit is None:
            for _ in weights:  # the gather is collective over the policy ranks
                pass
            return 0
        return self.refit.send(weights)


@ray.remote
class GenerationWorker(GeneratorHost):
    """A `GenerationBackend` (torch or vLLM), chosen by name through the registry."""

    def __init__(self, backend: str, model_path: str, backend_kwargs: dict[str, Any], *, num_threads: int = 1) -> None:
        _setup_process(num_threads)
        self.attach_generator(backend, model_path, backend_kwargs)
        self.refit: RefitGroup | None = None

    def join_refit(self, host: str, port: int, rank: int, world_size: int, device: str) -> None:
        self.refit = RefitGroup(tcp_store(host, port, world_size, False), rank, world_size, device=device)

    def receive_weights(self) -> None:
        self.refit.receive_into(self.backend.update_weights)
