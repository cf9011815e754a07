"""Placement and fan-out: start Ray, place the worker groups, and give the loop batch-level calls.

Owns: `ray.init` (a local Ray whose servers listen on 127.0.0.1 only, or `cluster.address`) and `ray.shutdown`, the
placement group on GPU clusters, DP sharding of batches (token-balanced with seqpack), the refit wiring, and the
colocation phases (grpo_app.colocation) around every call. The loop sees one object, `Workers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
import torch

from grpo_app.colocation import Colocation
from grpo_app.config import GRPOConfig
from grpo_app.devices import generation_tp_size
from grpo_app.refit import RefitPath, num_gpus_needed, refit_path
from grpo_app.reward_worker import RewardWorker, close_environment
from grpo_app.worker_logging import LOG_LEVEL_ENV
from grpo_app.workers import GenerationWorker, PolicyWorker
from rl_core.batch import TokenBatch
from rl_core.config import ConfigError
from rl_core.interfaces import Completion, RewardRequest, RewardResult, SamplingParams
from rl_core.metrics import combine_optimizer_steps
from rl_core.registry import GENERATION_BACKENDS
from rollout.environments import create_environment
from seqpack import balance_partitions

logger = logging.getLogger(__name__)


LOOPBACK = "127.0.0.1"
# How long a cluster that nodes can still join (cluster.address) gets to place the layout's GPUs before the run
# stops with an error naming the cluster.* keys (an autoscaler bringing up GPU nodes takes minutes, not this).
PLACEMENT_TIMEOUT_S = 1800.0
# How long a stopping run waits for the reward workers to close their scoring pools (Workers.shutdown): a pool
# closes in well under a second once the batch it is scoring ends, and that batch is bounded by the reward's
# time limit (default 10 s; a longer wait would hold up every Ctrl-C).
REWARD_CLOSE_TIMEOUT_S = 5.0


def start_ray(cfg: GRPOConfig) -> None:
    """Join `cluster.address` (Ray's token authentication left as the cluster sets it), or start a local
    Ray whose every server listens on 127.0.0.1 only."""
    if ray.is_initialized():
        return
    if cfg.cluster.address:
        logger.info("joining Ray cluster at %s", cfg.cluster.address)
        # One connection attempt (Ray's default is 20, each up to its 30 s GCS timeout): an address that
        # answers TCP but is no Ray fails in ~40 s instead of many minutes. (Shortening that 30 s would need
        # RAY_py_gcs_connect_timeout_s before ray is imported, which also cuts a local Ray's own startup.)
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "1")
        try:
            # no runtime_env of ours here: a job submitted to the cluster may carry its own (workers log at INFO)
            ray.init(address=cfg.cluster.address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:
            raise ConfigError(f"cluster.address={cfg.cluster.address!r}: Ray could not join a cluster there "
                              f"({str(exc).splitlines()[0]}); check the address and, if the cluster uses token "
                              "authentication, RAY_AUTH_TOKEN (see apps/grpo/README.md)") from None
        return
    # A local Ray has no other node to reach, so nothing needs to authenticate to it: no token.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray replaces a loopback node IP by the machine's address (so other nodes could join) and then its
    # GCS, raylet and worker gRPC servers listen on every interface; with "cluster mode" off it keeps
    # 127.0.0.1 and they listen on loopback only. Ray reads the switch at import: set the constant too,
    # and the variable for the processes Ray starts.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray starts workers at niceness 15 (to keep its own daemons responsive); here the workers are the
    # training itself, and on a shared machine niceness 15 hands their cores to any other process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if os.environ.get("RAY_ADDRESS"):
        logger.warning("RAY_ADDRESS=%s is set but cluster.address is not: starting a local Ray (set "
                       "cluster.address=auto to join that cluster)", os.environ["RAY_ADDRESS"])
    # address "local": a new local Ray even where RAY_ADDRESS is set or a `ray start` cluster runs on this
    # machine (ray.init() would join it, and then refuses num_cpus)
    # The driver's log level (--log-level) for the workers' logging: a local Ray's processes (the raylet, and the
    # workers it starts) inherit the environment the driver has as it starts them. (A job runtime_env's env_vars
    # did the same, but started every actor through Ray's runtime-env setup process, in a new worker, while the
    # workers Ray prestarts for the job sat unused: ~2 CPU-seconds a run.)
    before = os.environ.get(LOG_LEVEL_ENV)
    os.environ[LOG_LEVEL_ENV] = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    try:
        ray.init(address="local", num_cpus=cfg.cluster.num_cpus or os.cpu_count(), include_dashboard=False,
                 _node_ip_address=LOOPBACK, log_to_driver=True, configure_logging=False)
    finally:
        if before is None:
            del os.environ[LOG_LEVEL_ENV]
        else:
            os.environ[LOG_LEVEL_ENV] = before


def stop_ray() -> None:
    """`ray.shutdown()`, with this process's SIGTERM handler kept. When the driver's core worker shuts down, Ray
    resets SIGTERM to the default action (RayLog::UninstallSignalAction, undoing the handler ray.init installed,
    whoever replaced it since), and a local Ray's processes then take ~1.3 s to stop: a SIGTERM in that time
    killed the driver (exit -15, no last line). So: disconnect first, re-install the handler, then stop them."""
    from ray._private import worker as ray_worker

    handler = signal.getsignal(signal.SIGTERM)
    node, ray_worker._global_node = ray_worker._global_node, None  # ray.shutdown then leaves the processes be
    ray.shutdown()
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)  # Python's record of it is unchanged: re-install it in the kernel
    if node is not None:  # as ray.shutdown would have
        if node.is_head():
            node.destroy_external_storage()
        node.kill_all_processes(check_alive=False, allow_graceful=True, wait=False)


# Every actor's role in the run, by Ray actor id: Ray's errors name an actor by id and class only, and a run
# that stops on one should say "policy rank 1", not "PolicyWorker 219c71...". Filled as Workers creates actors
# (also while it starts: an actor can fail in its constructor).
ROLES: dict[str, str] = {}


def _role(actor: Any, role: str) -> Any:
    ROLES[actor._actor_id.hex()] = role
    return actor


def describe_failure(exc: ray.exceptions.RayError) -> str:
    """One line for the failure of an actor call: which actor (role, pid) and the original exception."""
    def last_line(text: str) -> str:
        return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")[:300]

    if isinstance(exc, ray.exceptions.RayTaskError):  # the actor method raised; the cause is the worker's own
        # What ray.get raises keeps only the cause; actor, method and pid are left in its first line:
        # "ray::PolicyWorker.train() (pid=14127, ip=127.0.0.1, actor_id=3990b4..., repr=...)"
        header = str(exc).split("\n", 1)[0]
        actor, method, pid = (re.search(pattern, header) for pattern in (r"actor_id=(\w+)", r"ray::([\w.]+)", r"pid=(\d+)"))
        role = ROLES.get(actor.group(1), "a Ray actor") if actor else "a Ray task"
        cause = exc.cause if exc.cause is not None else exc
        return (f"{role}{f' (pid {pid.group(1)})' if pid else ''} failed{f' in {method.group(1)}' if method else ''}: "
                f"{type(cause).__name__}: {last_line(str(cause)) or '(no message)'}")
    if isinstance(exc, ray.exceptions.RayActorError):
        role = ROLES.get(exc.actor_id or "", "a Ray actor")
        if exc.actor_init_failed:  # its constructor raised: the message ends with that exception
            return f"{role} failed to start: {last_line(exc.error_msg)}"
        pid = re.search(r"\bpid: (\d+)", exc.error_msg)
        return (f"{role}{f' (pid {pid.group(1)})' if pid else ''} died: its process exited unexpectedly "
                "(killed, out of memory, or crashed; Ray's account is above)")
    return f"{type(exc).__name__}: {last_line(str(exc))}"


def _split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    size = -(-len(items) // parts)
    return [list(items[i * size : (i + 1) * size]) for i in range(parts)]


def replica_params(params: SamplingParams, first_prompt: int) -> SamplingParams:
    """The sampling parameters of the replica whose share starts at prompt `first_prompt`: a seed of its own.

    For a backend that keys its draws on rows (the torch backend: (seed, local row, step)), replicas sharing the
    call's seed would draw the same noise for their first rows, their second rows, ... A backend that seeds each
    prompt (`seeds_each_prompt`: vLLM's request seeds) keeps the call's seed instead (`generate_by_replica`), so its
    samples do not depend on how many replicas there are. The first replica keeps the call's seed: one replica
    samples as before. Deterministic, so a resumed run samples what the original did."""
    if params.seed is None or first_prompt == 0:
        return params
    digest = hashlib.blake2b(f"{params.seed}:{first_prompt}".encode(), digest_size=8).digest()
    return dataclasses.replace(params, seed=int.from_bytes(digest, "little") >> 2)  # 62 bits, as vLLM's seeds


def generate_by_replica(replicas: list[list[Any]], prompts: list[list[int]], params: SamplingParams, *,
                        reseed: bool = True) -> Iterator[list[Completion]]:
    """Split `prompts` over the replicas (lists of generator actors: a tensor-parallel group of policy ranks,
    or one generation worker) and yield each replica's completions as soon as it finishes, prompt indices
    into `prompts`. Every rank of a replica gets the same prompts (TP ranks step together); the first
    rank's completions are the replica's. `reseed`: each replica its own seed (`replica_params`)."""
    offsets, offset, followers = {}, 0, []
    for (leader, *others), part in zip(replicas, _split(prompts, len(replicas))):
        if part:
            own = replica_params(params, offset) if reseed else params
            offsets[leader.generate.remote(part, own)] = offset
            followers += [g.generate.remote(part, own) for g in others]  # same tokens as the leader's
        offset += len(part)
    pending = list(offsets)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        completions = ray.get(done[0])
        for c in completions:
            c.prompt_index += offsets[done[0]]
        yield completions
    ray.get(followers)  # their errors surface here


@ray.remote(num_cpus=0)
def _node_ip() -> str:
    return ray.util.get_node_ip_address()


@ray.remote(num_cpus=0)
def _path_exists(path: str) -> bool:
    return os.path.exists(path)


def wait_for_placement(group: Any, needed: int, *, can_grow: bool, every_s: float = 60.0,
                       timeout_s: float = PLACEMENT_TIMEOUT_S, layout: str = "") -> None:
    """Wait until Ray has placed `group` (`needed` one-GPU bundles). A local Ray that sees fewer GPUs can
    never place it (Ray would wait silently forever): that is a ConfigError; a cluster nodes can join
    (cluster.address) is waited for, saying every `every_s` what it lacks, and after `timeout_s` it is a
    ConfigError too. `layout` names the cluster.* values that asked for the bundles."""
    total = int(ray.cluster_resources().get("GPU", 0))
    if not can_grow and total < needed:
        raise ConfigError(
            f"the layout needs {needed} GPU(s) but Ray sees {total} on this machine: set cluster.gpus_per_node "
            f"(and cluster.train_world_size) to what it has, or check CUDA_VISIBLE_DEVICES")
    waited = 0.0
    while True:
        wait_s = min(every_s, timeout_s - waited)
        try:
            ray.get(group.ready(), timeout=wait_s)
            return
        except ray.exceptions.GetTimeoutError:
            waited += wait_s
            have = (f"the Ray cluster has {int(ray.cluster_resources().get('GPU', 0))} GPU(s), "
                    f"{int(ray.available_resources().get('GPU', 0))} free")
            if waited >= timeout_s:
                # else Ray would place it once GPUs free up, and hold them for a run that has stopped
                ray.util.remove_placement_group(group)
                raise ConfigError(
                    f"Ray could not place {needed} one-GPU bundles in {waited:.0f} s ({layout}): {have}. Start "
                    "the missing nodes (apps/grpo/GPU.md), or lower cluster.num_nodes / cluster.train_world_size "
                    "to what the cluster has") from None
            logger.warning("waited %.0f s for %d one-GPU bundles: %s (%s)", waited, needed, have, layout)


def node_major_bundles(bundle_nodes: Sequence[str], world_size: int, gpus_per_node: int) -> list[int]:
    """Bundle indices in the order the layout uses them (policy ranks, then generation workers), given the
    node of each bundle: node by node, the nodes holding most bundles first, so policy rank r sits on
    node r // gpus_per_node and every block of `gpus_per_node` consecutive ranks (each tensor-parallel group,
    each vLLM replica of the policy ranks) shares one node.

    Needed because Ray's PACK numbers bundles across nodes in no node order: it sorts the bundles with
    std::sort, not stable, before filling node after node (src/ray/raylet/scheduling/policy/
    bundle_scheduling_policy.cc, SortRequiredResources / BundlePackSchedulingPolicy::Schedule); with more
    than 16 identical bundles bundle 0 and bundles 9-15 can share a node while 1-8 sit on another.
    A block that Ray split over two nodes (some node had fewer free GPUs than cluster.gpus_per_node) is a
    ConfigError: its tensor-parallel traffic would cross the network."""
    by_node: dict[str, list[int]] = {}
    for index, node in enumerate(bundle_nodes):
        by_node.setdefault(node, []).append(index)
    order = [i for indices in sorted(by_node.values(), key=len, reverse=True) for i in indices]  # stable sort
    for start in range(0, world_size, gpus_per_node):
        ranks = range(start, min(start + gpus_per_node, world_size))
        if len({bundle_nodes[order[r]] for r in ranks}) > 1:
            per_node = ", ".join(str(len(indices)) for indices in by_node.values())
            raise ConfigError(
                f"Ray placed policy ranks {ranks.start}-{ranks.stop - 1} on more than one node (GPUs of this run "
                f"per node: {per_node}), so their tensor-parallel groups would cross nodes: every node needs "
                f"cluster.gpus_per_node={gpus_per_node} free GPUs; free them, or set cluster.gpus_per_node and "
                "cluster.num_nodes to what the nodes have")
    return order


class Placement:
    """Where actors go. On CPU: anywhere on the local Ray (no GPUs to pin). On GPUs: one placement-group
    bundle per GPU the layout needs (`num_gpus_needed`, PACK: as few nodes as possible): the policy ranks'
    first, node-major (`node_major_bundles`), then those of generation workers on GPUs of their own;
    generation inside the policy ranks needs none (refit_path refuses a separate generation worker sharing
    a policy rank's GPU). Ray gives each actor its one GPU as CUDA_VISIBLE_DEVICES, so inside it the
    device is cuda:0 and LOCAL_RANK is 0."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.group = None
        needed = num_gpus_needed(cfg)
        self.bundles = list(range(needed))  # bundle of the i-th GPU user: policy ranks, then generation workers
        if cfg.cluster.gpus_per_node:
            from ray.util.placement_group import placement_group, placement_group_table

            cluster = cfg.cluster
            layout = (f"cluster.num_nodes={cluster.num_nodes} x cluster.gpus_per_node={cluster.gpus_per_node}, "
                      f"cluster.train_world_size={cluster.train_world_size}"
                      + (f" + generation.num_workers={needed - cluster.train_world_size}"
                         if needed > cluster.train_world_size else ""))
            self.group = placement_group([{"GPU": 1, "CPU": 1}] * needed, strategy="PACK")
            wait_for_placement(self.group, needed, can_grow=bool(cluster.address), timeout_s=PLACEMENT_TIMEOUT_S,
                               layout=layout)
            if cluster.num_nodes > 1:  # on one node every order is node-major
                nodes = placement_group_table(self.group)["bundles_to_node_id"]
                self.bundles = node_major_bundles([nodes[i] for i in range(needed)], cluster.train_world_size,
                                                  cluster.gpus_per_node)

    def remove(self) -> None:
        """Give the GPUs back (Ray frees a job's groups only when its driver exits)."""
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None

    def _options(self, user: int, num_gpus: float) -> dict[str, Any]:
        """Ray options of the `user`-th GPU user (policy ranks, then generation workers): its bundle on GPUs."""
        if self.group is None:
            return {"num_cpus": 0, "num_gpus": 0}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": 0, "num_gpus": num_gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=self.bundles[user])}

    def policy_options(self, rank: int) -> dict[str, Any]:
        return self._options(rank, 1.0)

    def generation_options(self, index: int) -> dict[str, Any]:
        return self._options(self.cfg.cluster.train_world_size + index, 1.0)

    def _task_options(self, rank: int) -> dict[str, Any]:
        """A zero-resource task on policy rank `rank`'s node (inside its bundle on GPUs)."""
        return {k: v for k, v in self._options(rank, 0).items() if k != "num_gpus"}

    def node_ip(self, rank: int) -> str:
        """The address policy rank `rank` listens on for the groups it hosts: its node's, 127.0.0.1 for a local
        CPU run."""
        if self.group is None and not self.cfg.cluster.address:
            return LOOPBACK
        return ray.get(_node_ip.options(**self._task_options(rank)).remote())


def check_shared_dir(placement: Placement, directory: str | os.PathLike[str], key: str) -> None:
    """Every policy rank's node sees the driver's `directory` (checkpoints: each rank writes its shard under
    a directory the driver creates, then the driver writes the manifest and renames it; on resume the ranks
    read what the driver found). A node-local directory would leave each node's shards on that node and a
    published checkpoint without them: a ConfigError naming `key`."""
    root = Path(directory).absolute()
    root.mkdir(parents=True, exist_ok=True)
    fd, marker = tempfile.mkstemp(dir=root, prefix=".shared-check-")
    os.close(fd)
    try:
        ranks = range(placement.cfg.cluster.train_world_size)
        seen = ray.get([_path_exists.options(**placement._task_options(r)).remote(marker) for r in ranks])
    finally:
        os.unlink(marker)
    missing = [r for r, ok in zip(ranks, seen) if not ok]
    if missing:
        raise ConfigError(
            f"{key}: {root} (on the driver's node) is not visible from the node(s) of policy rank(s) {missing}: "
            "every rank writes its checkpoint shard there and the driver reads them back, so it must be on a "
            "filesystem every node mounts at the same path (apps/grpo/GPU.md)")


def cpu_threads(cfg: GRPOConfig, cores: int) -> int:
    """torch threads of each policy rank and generation worker. On CPU the cores go to the processes that compute
    at once: the policy ranks, and with grpo.async_rollouts the generation workers beside them (more threads than
    cores would slow both sides down)."""
    if cfg.cluster.gpus_per_node:
        return 4
    busy = cfg.cluster.train_world_size + (cfg.generation.num_workers if cfg.grpo.async_rollouts else 0)
    return max(1, cores // busy)


class Workers:
    """Every actor of a run, with batch-level operations for the loop."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.policy: list[Any] = []
        self.generators: list[Any] = []
        self.rewarders: list[Any] = []
        self.local_env = None
        self.in_process = False
        # one thread: driver-side scoring overlaps generation but never runs twice at once
        self._scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
        self.placement = Placement(cfg)
        try:
            self._start(cfg)
        except BaseException:  # a failed or interrupted start: stop what did start (reward pools close their dirs)
            self.shutdown()
            raise

    def _start(self, cfg: GRPOConfig) -> None:
        world = cfg.cluster.train_world_size
        threads = cpu_threads(cfg, os.cpu_count() or 1)
        placement = self.placement
        if cfg.cluster.address and cfg.checkpointing.enabled:  # a local Ray is one machine: one filesystem
            check_shared_dir(placement, cfg.checkpoint_dir,
                             "checkpointing.dir" if cfg.checkpointing.dir else "logger.log_dir (its checkpoints/)")
        with_reference = cfg.loss.kl_coef != 0.0
        self.policy = [
            _role(PolicyWorker.options(**placement.policy_options(rank)).remote(
                cfg.policy, rank, world, with_reference=with_reference, num_threads=threads), f"policy rank {rank}")
            for rank in range(world)
        ]
        # Policy rank 0 hosts the stores of the training group and of the refit group, each on a port its OS picks
        # as it listens (a port found free ahead can be taken before it is bound); the others get it as an
        # ObjectRef, which Ray resolves before their call runs. The engines build while the generators start.
        host = placement.node_ip(0)
        port = self.policy[0].open_store.remote(host, world)
        started = [w.start.remote(host, port) for w in self.policy]
        path = refit_path(cfg)
        self.in_process = path is RefitPath.IN_PROCESS
        if self.in_process:  # hybrid: every policy rank generates; refit is a copy inside each process
            ray.get([w.attach_generator.remote(cfg.generation.backend, cfg.policy.model_name,
                                               cfg.generation.backend_kwargs) for w in self.policy])
            self.generators = list(self.policy)
            tp = generation_tp_size(cfg.generation.backend_kwargs)
        else:
            self.generators = [
                _role(GenerationWorker.options(**placement.generation_options(i)).remote(
                    cfg.generation.backend, cfg.policy.model_name, cfg.generation.backend_kwargs,
                    num_threads=threads), f"generation worker {i}")
                for i in range(cfg.generation.num_workers)
            ]
            tp = 1  # a generation worker spawns its own tensor-parallel workers
        # one replica per group: its ranks get the same prompts (TP ranks step together), its first answers
        self.replicas = [self.generators[i : i + tp] for i in range(0, len(self.generators), tp)]
        self.rewarders = [_role(RewardWorker.options(num_cpus=0).remote(cfg.env.name, cfg.env.kwargs), f"reward worker {i}")
                          for i in range(cfg.env.num_workers)]
        self.local_env = None if self.rewarders else create_environment(cfg.env.name, **cfg.env.kwargs)
        self.dp_layout = ray.get(started)  # (dp_rank, dp_size) per rank
        self.dp_size = self.dp_layout[0][1]
        if not self.in_process:
            refit_world, device = 1 + len(self.generators), "cuda" if path is RefitPath.NCCL else "cpu"
            port = self.policy[0].open_store.remote(host, refit_world)  # policy rank 0 sends
            ray.get([w.join_refit.remote(refit_world, device) for w in self.policy]
                    + [g.join_refit.remote(host, port, i + 1, refit_world, device)
                       for i, g in enumerate(self.generators)])
        self.colocation = Colocation(
            cfg.generation.colocated,
            policy=lambda method, **kwargs: ray.get([getattr(w, method).remote(**kwargs) for w in self.policy]),
            generators=lambda method: ray.get([getattr(g, method).remote() for g in self.generators]))
        logger.info("workers up: %d policy ranks (dp=%d), %s, %s; refit: %s%s", world, self.dp_size,
                    "generation in the policy ranks" if self.in_process else f"{len(self.generators)} generation",
                    f"{len(self.rewarders)} reward" if self.rewarders else "rewards in the driver", path.value,
                    f"; KL reference: the initial weights (loss.kl_coef={cfg.loss.kl_coef})" if with_reference else "")

    # ---- policy --------------------------------------------------------------------------------------
    def _shards(self, batch: TokenBatch) -> list[list[int]]:
        return balance_partitions(batch.lengths, self.dp_size, method="kk", equal_size=True)

    def compute_logprobs(self, batch: TokenBatch, reference: bool = False) -> list[torch.Tensor]:
        self.colocation.to_training()
        shards = self._shards(batch)
        futures = [w.compute_logprobs.remote(batch.select(shards[dp]), reference)
                   for w, (dp, _) in zip(self.policy, self.dp_layout)]
        per_rank = ray.get(futures)
        out: list[torch.Tensor | None] = [None] * len(batch)
        lengths = batch.lengths
        for (dp, _), flat in zip(self.dp_layout, per_rank):  # each DP shard's logprobs come back concatenated
            for index, logprobs in zip(shards[dp], flat.split([lengths[i] for i in shards[dp]])):
                out[index] = logprobs
        return out  # type: ignore[return-value]

    def train(self, batch: TokenBatch, loss_fn: Any) -> dict[str, float]:
        """One optimizer step per global batch of `policy.train_global_batch_size` sequences."""
        self.colocation.to_training()
        size = self.cfg.policy.train_global_batch_size
        steps = []
        for start in range(0, len(batch), size):
            part = batch.select(range(start, min(start + size, len(batch))))
            shards = self._shards(part)
            results = ray.get([w.train.remote(part.select(shards[dp]), loss_fn)
                               for w, (dp, _) in zip(self.policy, self.dp_layout)])
            steps.append(results[0])  # metrics are already reduced over DP inside the engine
        return combine_optimizer_steps(steps)

    # Absolute paths: a relative one would resolve against each worker's working directory, which is the
    # directory `ray start` ran in on its node (the raylet's), not the driver's.
    def save_checkpoint(self, path: str) -> None:
        self.colocation.to_training()
        ray.get([w.save_checkpoint.remote(os.path.abspath(path)) for w in self.policy])

    def save_hf(self, path: str) -> None:
        """Every policy rank takes part (the full tensors are gathered); rank 0 writes."""
        self.colocation.to_training()
        ray.get([w.save_hf.remote(os.path.abspath(path)) for w in self.policy])

    def load_checkpoint(self, path: str) -> None:
        self.colocation.to_training()
        ray.get([w.load_checkpoint.remote(os.path.abspath(path)) for w in self.policy])

    # ---- generation and rewards ------------------------------------------------------------------------
    def refit(self) -> int:
        """The policy's weights into the generators; colocated, the devices are the generators' after it."""
        def send() -> int:
            if self.in_process:
                return int(ray.get([w.refit_in_process.remote() for w in self.policy])[0])
            sent = ray.get([w.send_weights.remote() for w in self.policy]
                           + [g.receive_weights.remote() for g in self.generators])
            return int(sent[0])

        return self.colocation.refit(send)

    def generate_parts(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[Completion]]:
        """Each generator's completions as soon as it finishes (finishing order; prompt indices into
        `prompts`), so the caller can score one share while the others still generate."""
        self.colocation.to_generation()
        backend = GENERATION_BACKENDS.get(self.cfg.generation.backend, config_key="generation.backend")
        reseed = not getattr(backend, "seeds_each_prompt", False)
        yield from generate_by_replica(self.replicas, prompts, params, reseed=reseed)

    def submit_score(self, requests: list[RewardRequest]) -> Callable[[], list[RewardResult]]:
        """Start scoring now (reward actors, or the driver's environment on a thread); call the result to wait.
        The caller checks env.max_failed_reward_fraction on the whole batch (loop.rollout): `requests` may be one
        generator's share of it."""
        if self.local_env is not None:
            return self._scoring.submit(self.local_env.score, requests).result
        refs = [w.score.remote(p) for w, p in zip(self.rewarders, _split(requests, len(self.rewarders))) if p]
        return lambda: [r for part in ray.get(refs) for r in part]

    def shutdown(self) -> None:
        """Kill every actor. The reward workers first close their environments, for up to REWARD_CLOSE_TIMEOUT_S
        (a close waits for the batch the worker is scoring): ray.kill ends a process with nothing of it run, and
        a closed scoring pool has removed its scratch directories (else the next run on the node removes them)."""
        closing = [w.close.remote() for w in self.rewarders]
        for actor in (*self.policy, *([] if self.in_process else self.generators)):
            ray.kill(actor)
        self.placement.remove()  # else the GPUs stay reserved until the driver exits
        self._scoring.shutdown(wait=True)
        close_environment(self.local_env)
        done, _ = ray.wait(closing, num_returns=len(closing), timeout=REWARD_CLOSE_TIMEOUT_S)
        with contextlib.suppress(ray.exceptions.RayError):  # a reward worker that died has nothing to close
            ray.get(done)
        for actor in self.rewarders:
            ray.kill(actor)
