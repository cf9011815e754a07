"""`auto` device, precision and generator placement: resolved once, from the hardware, before validation.

Owns: `Hardware` (what the driver sees: CUDA, bf16 support, GPU count) and `resolve_auto`, a pure function
of (raw config, Hardware) that turns every `auto` into a concrete value, so the saved config says what ran.
Explicit user values always win. It does not decide the refit path (grpo_app.refit.refit_path) nor start
anything.

What `auto` means:
- `cluster.device`: cuda when `cluster.gpus_per_node > 0` (a cluster's head may have no GPU) or, for a
  local run, when the driver sees a GPU; else cpu. On cuda, `cluster.gpus_per_node: 0` becomes the
  local GPU count.
- `policy.precision`: bfloat16 on GPUs that support it, else float32 (no fp16 loss scaling here).
- `generation.in_policy_workers` (when unset): true on cuda with `generation.colocated` (verl's hybrid
  engine: no NCCL group between two processes on one GPU), false otherwise (CPU runs as before).
- `generation.backend_kwargs`: the built-in generators run on the policy's device and precision (`device`,
  `dtype`); a vLLM generator inside the policy ranks uses vLLM's `external_launcher` executor, one
  replica per `tensor_parallel_size` ranks (`resolve_external_launcher`). A third-party backend gets only
  the keys its user sets.
"""

from __future__ import annotations

import copy
import functools
import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from rl_core.config import ConfigError

logger = logging.getLogger(__name__)

AUTO = "auto"
DEVICES = ("auto", "cpu", "cuda")
NO_LOCAL_GPU = ("cluster.device=cuda but this machine has no usable CUDA GPU (torch.cuda.is_available() is False): "
                "set cluster.device=cpu and cluster.gpus_per_node=0, or cluster.address to join a GPU cluster")
# The built-in backends' keys the trainer fills in; a third-party backend gets only what its user sets.
BACKENDS_WITH_DEVICE_KWARG = ("torch",)  # vLLM picks its device from its platform and the visible GPUs
BACKENDS_WITH_DTYPE_KWARG = ("torch", "vllm")
BACKENDS_WITH_EXTERNAL_LAUNCHER = ("vllm",)  # inside the policy ranks: vLLM's executor on the ranks' world


@dataclass(frozen=True)
class Hardware:
    """What the driver process sees; tests pass simulated values."""

    cuda_available: bool
    bf16_supported: bool
    num_gpus: int


def detect_hardware() -> Hardware:
    """What the driver sees, without creating a CUDA context in it (`is_available` and `device_count` create none)."""
    import torch

    if not torch.cuda.is_available():
        return Hardware(cuda_available=False, bf16_supported=False, num_gpus=0)
    return Hardware(cuda_available=True, bf16_supported=_native_bf16(), num_gpus=torch.cuda.device_count())


@functools.cache
def _native_bf16() -> bool:
    """Whether GPU 0 computes in bf16 natively (compute capability >= 8.0; emulated bf16 on a V100 or T4 is slow).

    Asked in a child process: `torch.cuda.is_bf16_supported` creates a CUDA context, which the driver would hold on
    GPU 0 for the whole run (a few hundred MiB, out of what the policy and vLLM share on one GPU)."""
    probe = "import torch; print(torch.cuda.is_bf16_supported(including_emulation=False))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"probing the GPU for bf16 failed (python -c {probe!r}):\n{result.stderr[-2000:]}")
    return result.stdout.strip().splitlines()[-1] == "True"


def _section(data: dict, key: str) -> dict:
    section = data.setdefault(key, {})
    if not isinstance(section, dict):
        raise ConfigError(f"config section {key!r} must be a mapping; got {section!r}")
    return section


def resolve_device(cluster: dict, hw: Hardware) -> str:
    """The concrete `cluster.device` (and, on cuda, `gpus_per_node`, in place); hardware checks come later
    (`check_hardware`), so a GPU recipe still validates on a CPU-only machine."""
    device = cluster.get("device", AUTO)
    if device not in DEVICES:
        raise ConfigError(f"cluster.device={device!r}; choose one of {list(DEVICES)}")
    gpus = cluster.get("gpus_per_node", 0) or 0
    local = not cluster.get("address")
    if device == AUTO:
        device = "cuda" if gpus > 0 or (local and hw.cuda_available) else "cpu"
    if device == "cpu" and gpus > 0:
        raise ConfigError(f"cluster.device=cpu but cluster.gpus_per_node={gpus}: set cluster.gpus_per_node=0 for a "
                          "CPU run, or cluster.device=cuda")
    if device == "cuda" and gpus == 0:
        if not local:
            raise ConfigError("cluster.device=cuda on a cluster (cluster.address set): set cluster.gpus_per_node "
                              "to the GPUs per node; the driver cannot see the workers' GPUs")
        if hw.num_gpus == 0:  # said here: the placement checks that follow would blame the layout
            raise ConfigError(NO_LOCAL_GPU)
        cluster["gpus_per_node"] = hw.num_gpus
    return device


def check_hardware(cluster: Any, hw: Hardware) -> None:
    """A local run asks for no more than this machine has (`cluster` is the validated ClusterConfig)."""
    if cluster.address:
        return  # Ray places the actors on the cluster's GPUs; the driver cannot count them
    if cluster.num_nodes > 1:
        raise ConfigError(f"cluster.num_nodes={cluster.num_nodes} needs a Ray cluster: start one (apps/grpo/GPU.md) "
                          "and set cluster.address=auto, or set cluster.num_nodes=1")
    if cluster.device == "cuda" and not hw.cuda_available:
        raise ConfigError(NO_LOCAL_GPU)
    if cluster.gpus_per_node > hw.num_gpus:
        raise ConfigError(f"cluster.gpus_per_node={cluster.gpus_per_node} but this machine has {hw.num_gpus} GPU(s): "
                          f"set cluster.gpus_per_node<={hw.num_gpus} (and cluster.train_world_size to fit)")


PRECISIONS = (AUTO, "float32", "bfloat16", "float16")
# what verl and DeepSpeed users write: named in the error, not accepted (one spelling in configs and checkpoints)
PRECISION_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16"}


def resolve_precision(policy: dict, device: str, hw: Hardware, *, local: bool) -> str:
    precision = policy.get("precision", "float32")
    if precision not in PRECISIONS:  # here, before validation, which would not list `auto`
        alias = PRECISION_ALIASES.get(str(precision).lower())
        hint = f" ({precision} is spelt {alias} here)" if alias else ""
        raise ConfigError(f"policy.precision={precision!r}: choose one of {list(PRECISIONS)}{hint}")
    if precision != AUTO:
        return precision
    # A remote cluster's GPUs are invisible to the driver: assume bf16 there (every GPU since Ampere).
    bf16 = device == "cuda" and (hw.bf16_supported or not local)
    return "bfloat16" if bf16 else "float32"


def resolve_generation(generation: dict, device: str, precision: str, world_size: int) -> None:
    """The generator's placement and kwargs (in place): on the policy's device and in its precision."""
    colocated = generation.get("colocated", True)
    if generation.get("in_policy_workers", AUTO) in (AUTO, None):
        generation["in_policy_workers"] = device == "cuda" and colocated
    kwargs = generation.setdefault("backend_kwargs", {})
    backend = generation.get("backend", "torch")
    if backend in BACKENDS_WITH_DEVICE_KWARG:
        kwargs.setdefault("device", device)
        if kwargs["device"] == "cpu" and device == "cuda":
            logger.warning("generation.backend_kwargs.device=cpu while the policy trains on cuda: generation "
                           "runs on the CPU (slow) and every refit copies the weights to host memory; remove the "
                           "key to generate on the policy's GPU")
    if backend in BACKENDS_WITH_DTYPE_KWARG:
        kwargs.setdefault("dtype", precision)
    if device == "cpu" and kwargs.get("enable_sleep_mode"):  # else vllm.LLM fails inside a Ray actor
        raise ConfigError("generation.backend_kwargs.enable_sleep_mode=true on cluster.device=cpu: vLLM's CPU backend "
                          "has no sleep mode (vllm.LLM raises 'Sleep mode is not supported on current platform'); "
                          "remove the key")
    if generation["in_policy_workers"] and backend in BACKENDS_WITH_EXTERNAL_LAUNCHER:
        resolve_external_launcher(kwargs, device, world_size)


def generation_tp_size(backend_kwargs: dict[str, Any]) -> int:
    """Policy ranks per generator replica when the generator lives in the policy ranks (vLLM's TP size)."""
    return int(backend_kwargs.get("tensor_parallel_size", 1))


def resolve_external_launcher(kwargs: dict[str, Any], device: str, world_size: int) -> None:
    """vLLM inside the policy ranks (verl's hybrid engine): its workers join the ranks' torch.distributed
    world instead of spawning processes, and every `tensor_parallel_size` consecutive ranks form one
    independent replica that generates its own share of the prompts.

    vLLM's `data_parallel_size` stays 1: with external_launcher, data_parallel_size > 1 makes the ranks
    step in lockstep (an all-reduce and dummy batches every engine step, vllm/v1/engine/llm_engine.py
    `has_unfinished_requests_dp`), so a rank without prompts of its own leaves the others waiting forever;
    it exists for MoE expert parallelism, not for dense replicas.

    On CPU, tensor_parallel_size must be 1: vLLM's CPU tensor-parallel all-reduce uses /dev/shm segments
    named after the init method (vllm/v1/worker/cpu_worker.py `VLLM_DIST_IDENT`, vllm/distributed/
    device_communicators/cpu_communicator.py `make_group_name`), which is the constant "env://" under
    external_launcher. Every such run on a machine uses the same names: a second one, or any run after a
    killed one (the segments stay), fails with "create shm in SHMManager failed. errno: 17" (EEXIST).
    """
    kwargs.setdefault("distributed_executor_backend", "external_launcher")
    if device == "cuda":
        # Ray shows each policy rank its own GPU alone (CUDA_VISIBLE_DEVICES), and vLLM's custom all-reduce
        # indexes that list by TP rank (custom_all_reduce.py `_can_p2p`): IndexError at start-up when TP > 1.
        # NCCL all-reduces instead, as in verl's hybrid engine.
        kwargs.setdefault("disable_custom_all_reduce", True)
    tp = generation_tp_size(kwargs)
    if tp < 1:  # before the modulo below; the backend's check_options would say the same, but later
        raise ConfigError(f"generation.backend_kwargs.tensor_parallel_size={tp} must be >= 1")
    if world_size % tp:
        raise ConfigError(f"generation.backend_kwargs.tensor_parallel_size={tp} must divide "
                          f"cluster.train_world_size={world_size} when the generator lives in the policy ranks")
    if device == "cpu" and tp > 1:
        raise ConfigError(f"generation.backend_kwargs.tensor_parallel_size={tp} with generation.in_policy_workers=true "
                          "on cluster.device=cpu: vLLM's CPU tensor parallelism under external_launcher names its "
                          "/dev/shm segments after the fixed 'env://' init method, so a second run on this machine or "
                          "any run after a killed one fails ('create shm in SHMManager failed. errno: 17'); use "
                          "tensor_parallel_size=1 (every policy rank its own replica) or generation.in_policy_workers"
                          "=false")
    if int(kwargs.get("data_parallel_size", 1)) != 1:
        raise ConfigError(f"generation.backend_kwargs.data_parallel_size={kwargs['data_parallel_size']} with "
                          "generation.in_policy_workers=true: every tensor-parallel group of policy ranks is already "
                          "its own vLLM replica, and vLLM's data parallelism would make the ranks wait on each other "
                          "every step (a rank without prompts hangs the rest); remove the key")


def resolve_auto(data: dict[str, Any], hw: Hardware) -> dict[str, Any]:
    """A copy of the raw config with every `auto` made concrete for `hw` (see the module docstring)."""
    data = copy.deepcopy(data)
    cluster, policy, generation = _section(data, "cluster"), _section(data, "policy"), _section(data, "generation")
    device = resolve_device(cluster, hw)
    cluster["device"] = device
    precision = resolve_precision(policy, device, hw, local=not cluster.get("address"))
    if "precision" in policy or precision != "float32":
        policy["precision"] = precision
    resolve_generation(generation, device, precision, int(cluster.get("train_world_size", 1)))
    logger.info("device %s, precision %s, generation %s (%s)", device, precision,
                "in the policy ranks" if generation["in_policy_workers"] else "in its own workers",
                ", ".join(f"{k}={v}" for k, v in sorted(generation["backend_kwargs"].items())))
    return data
