"""Checks that run before any worker starts: every input the run needs exists and is valid.

Resolves `tiny:<arch>` model names to a locally built, cached tiny checkpoint (the CPU default), and
checks what would otherwise fail minutes later inside a Ray actor: counts and sizes, the engine layout
against `cluster.train_world_size`, the optimizer, `generation.backend_kwargs` and `env.kwargs` against
the constructors they are passed to (and the backend's own value rules, `check_options`), the prompt datasets
(a Hub dataset's split and subset from its file listing), the model directory (grpo_app.model_check),
`cluster.address` and, with logger.wandb.enabled, that wandb is installed.
Every failure is a ConfigError naming the key or file and the fix; main() turns it into exit code 2.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import importlib.util
import inspect
import logging
import math
import os
import re
import socket
import types
import typing
from collections.abc import Callable, Collection
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Literal

from grpo_app import program_name
from grpo_app.checkpoint import HF_DIR, STATE_FILE
from grpo_app.config import EnvConfig, GRPOConfig, WandbConfig
from grpo_app.devices import check_hardware, detect_hardware
from grpo_app.model_check import check_model_dir
from grpo_app.model_shapes import SHAPE_PREFIX, cached_shape_checkpoint
from grpo_app.ported_configs import explain_engine_error
from rl_core.config import (
    BUILTIN_ENGINE_SECTIONS,
    ConfigError,
    OptimizerConfig,
    PolicyConfig,
    check_known_keys,
    closest_key,
    to_dict,
    yaml_hint,
)
from rl_core.interfaces import ChecksModel, ValidatesConfig
from rl_core.registry import ENGINES, GENERATION_BACKENDS

logger = logging.getLogger(__name__)
TINY_PREFIX = "tiny:"
ADDRESS_PROBE_TIMEOUT_S = 10.0

# The smallest sensible value of every integer of the typed configs (tests check that none is missing).
INT_BOUNDS: dict[str, int] = {
    "policy.train_global_batch_size": 1, "policy.train_micro_batch_size": 1, "policy.logprob_batch_size": 1,
    "policy.logprob_chunk_tokens": 1, "policy.top_k": 0,
    "policy.scheduler.warmup_steps": 0, "policy.scheduler.total_steps": 1,
    "policy.sequence_packing.train_mb_tokens": 1, "policy.sequence_packing.logprob_mb_tokens": 1,
    "policy.dynamic_batching.train_mb_tokens": 1, "policy.dynamic_batching.logprob_mb_tokens": 1,
    "policy.dynamic_batching.sequence_length_round": 1,
    "grpo.num_prompts_per_step": 1, "grpo.num_generations_per_prompt": 2, "grpo.max_steps": 1,
    "grpo.val_every": 0, "grpo.num_val_prompts": 1, "grpo.seed": 0, "grpo.max_dynamic_sampling_rounds": 1,
    "generation.max_new_tokens": 1, "generation.top_k": 0, "generation.num_workers": 1,
    "env.num_workers": 0, "env.num_generated_train_prompts": 1, "env.max_prompt_tokens": 1,
    "cluster.num_nodes": 1, "cluster.gpus_per_node": 0, "cluster.train_world_size": 1, "cluster.num_cpus": 1,
    "checkpointing.save_every": 1, "checkpointing.keep_top_k": 1,
}


def check_bounds(cfg: GRPOConfig) -> None:
    """Counts and sizes where 0 (or a negative value) makes no sense: the key, the value and the bound."""
    tree = to_dict(cfg)
    for dotted, low in INT_BOUNDS.items():
        value: Any = tree
        for part in dotted.split("."):
            value = value[part]
        if value is not None and value < low:
            raise ConfigError(f"{dotted}={value} must be >= {low}")


def check_kwargs(target: Callable[..., Any], kwargs: dict[str, Any], key: str, *, given: Collection[str] = ()) -> None:
    """`kwargs` (config section `key`) fit `target`'s signature: unknown keys name the closest valid one,
    missing required ones are named, values of plainly annotated parameters (str, int, float, bool, or
    those or None) have that type; `given` are the arguments the caller passes itself."""
    try:
        params = inspect.signature(target, eval_str=True).parameters
    except (NameError, TypeError, SyntaxError):  # an annotation that does not resolve here: names only
        params = inspect.signature(target).parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in given]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check_known_keys(key, kwargs, names)
    for name in names:
        if params[name].default is inspect.Parameter.empty and name not in kwargs:
            raise ConfigError(f"{key}.{name} is required by {getattr(target, '__qualname__', target)}; set it")
        if name in kwargs:
            _check_plain_type(f"{key}.{name}", kwargs[name], params[name].annotation)


PLAIN_TYPES = (str, int, float, bool, type(None))


SEQUENCES = (list, tuple, collections.abc.Sequence)


def _check_plain_type(key: str, value: Any, annotation: Any) -> None:
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if any(typing.get_origin(t) is Literal for t in allowed):  # a fixed set of values (or those and None)
        choices = [choice for t in allowed if typing.get_origin(t) is Literal for choice in typing.get_args(t)]
        if value not in choices and not (value is None and type(None) in allowed):
            near = closest_key(str(value), [str(c) for c in choices])
            raise ConfigError(f"{key}={value!r} must be one of {choices}{f'; did you mean {near!r}?' if near else ''}")
        return
    if not allowed or not all(t in PLAIN_TYPES or _plain_sequence(t) for t in allowed):
        return  # anything richer (dicts, classes, nested lists) is the callee's to check
    if not any(_is(value, t) for t in allowed):
        names = " or ".join("null" if t is type(None) else _type_name(t) for t in allowed)
        hint = " (a list is written [1, 2])" if any(map(_plain_sequence, allowed)) else yaml_hint(value)
        hint = " (quote strings that YAML would read as numbers or booleans)" if str in allowed else hint
        raise ConfigError(f"{key} must be {names}; got {type(value).__name__} {value!r}{hint}")


def _plain_sequence(t: Any) -> bool:
    """`list[int]`, `Sequence[str]`, ...: a sequence of one plain type."""
    args = typing.get_args(t)
    return typing.get_origin(t) in SEQUENCES and len(args) == 1 and args[0] in PLAIN_TYPES


def _is(value: Any, t: Any) -> bool:
    if _plain_sequence(t):
        return isinstance(value, list | tuple) and all(_is(v, typing.get_args(t)[0]) for v in value)
    return type(value) in ({t, int} if t is float else {t})  # YAML writes 1.0 as 1 too


def _type_name(t: Any) -> str:
    return f"a list of {typing.get_args(t)[0].__name__}" if _plain_sequence(t) else t.__name__


def check_optimizer(optimizer: OptimizerConfig) -> None:
    """The optimizer is a torch.optim class and accepts its kwargs (torch's own value checks included)."""
    import torch

    cls = getattr(torch.optim, optimizer.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                 and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]
        near = closest_key(optimizer.name, names)
        hint = f"; did you mean '{near}'?" if near else f"; choose one of {sorted(names)}"
        raise ConfigError(f"policy.optimizer.name={optimizer.name!r} is not a torch.optim optimizer{hint}")
    check_kwargs(cls, optimizer.kwargs, "policy.optimizer.kwargs", given=("params",))
    lr = optimizer.kwargs["lr"]
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
        raise ConfigError(f"policy.optimizer.kwargs.lr={lr!r} must be a finite number >= 0")
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **optimizer.kwargs)
    except (ValueError, TypeError, IndexError) as exc:  # IndexError: a list too short (betas=[0.9])
        listed = [k for k, v in optimizer.kwargs.items() if isinstance(v, str) and "," in v]  # betas=0.9,0.95
        hint = f" (policy.optimizer.kwargs.{listed[0]} is a string: write a list as [a, b])" if listed else ""
        raise ConfigError(f"policy.optimizer.kwargs {optimizer.kwargs} are rejected by torch.optim."
                          f"{optimizer.name}: {exc}{hint}") from None


def check_schedule(cfg: GRPOConfig) -> None:
    """A decaying lr schedule of another length than the run, said once before it: a shorter one holds the lr at
    min_lr_ratio x lr for the rest of the run (0 by default: steps that train nothing), a longer one ends the run
    before the decay does (the default total_steps=1000 under a 100-step cosine run ended at 0.977 x lr)."""
    sched = cfg.policy.scheduler
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    optimizer_steps = cfg.grpo.max_steps * max(1, samples // cfg.policy.train_global_batch_size)
    if sched.decay == "constant" or sched.total_steps == optimizer_steps:
        return
    if sched.total_steps < optimizer_steps:
        logger.warning("policy.scheduler.total_steps=%d is fewer than this run's %d optimizer steps (grpo.max_steps=%d): "
                       "after it the lr stays at min_lr_ratio x lr = %g; set total_steps=%d to decay over the run",
                       sched.total_steps, optimizer_steps, cfg.grpo.max_steps,
                       sched.min_lr_ratio * float(cfg.policy.optimizer.kwargs["lr"]), optimizer_steps)
    else:
        logger.warning("policy.scheduler.total_steps=%d is more than this run's %d optimizer steps (grpo.max_steps=%d): "
                       "the %s decay ends the run at %.3g x lr, not at min_lr_ratio=%g; set total_steps=%d to decay over "
                       "the run", sched.total_steps, optimizer_steps, cfg.grpo.max_steps, sched.decay,
                       sched.lr_factor(optimizer_steps - 1), sched.min_lr_ratio, optimizer_steps)


VAL_METRICS = ("val/reward_mean", "val/accuracy")  # loop.validate's (accuracy: tasks that judge correctness)


def check_checkpointing(cfg: GRPOConfig) -> None:
    """A run that saves no model is said before it starts. keep-top-k ranks checkpoints by `checkpointing.metric`: a
    validation metric that does not exist is an error now (it was a warning at the first checkpoint, 20 steps in, and
    keep-top-k kept the newest), and checkpoints that no validation scores are said before the run."""
    ckpt, val_every = cfg.checkpointing, cfg.grpo.val_every
    if not ckpt.enabled and ckpt.save_hf != "never":
        logger.warning("checkpointing.enabled=false: the trained policy is not saved (checkpointing.save_hf=%s writes "
                       "into a checkpoint); set checkpointing.enabled=true to keep it", ckpt.save_hf)
    if not ckpt.enabled or not ckpt.metric.startswith("val/"):  # a train/rollout metric scores every checkpoint
        return
    if ckpt.metric not in VAL_METRICS:
        near = closest_key(ckpt.metric, list(VAL_METRICS))
        raise ConfigError(f"checkpointing.metric={ckpt.metric!r} is not a validation metric; they are "
                          f"{list(VAL_METRICS)}{f' (did you mean {near!r}?)' if near else ''}, or a train/ or "
                          "rollout/ metric of the step")
    if not val_every:
        logger.warning("checkpointing.metric=%s with grpo.val_every=0: no validation scores a checkpoint, so "
                       "keep-top-k keeps the newest %d", ckpt.metric, ckpt.keep_top_k)
    elif ckpt.save_every % val_every:
        logger.warning("checkpointing.save_every=%d is not a multiple of grpo.val_every=%d: checkpoints saved between "
                       "validations get no %s and rank last in keep-top-k", ckpt.save_every, val_every, ckpt.metric)


def _model_parallel(engine_cfg: Any) -> dict[str, int]:
    """The model-parallel degrees an engine's validated section sets (megatron: tp/pp/cp; dtensor: TP)."""
    degrees = {name: getattr(engine_cfg, name) for name in ("tp", "pp", "cp") if hasattr(engine_cfg, name)}
    if not degrees and hasattr(engine_cfg, "tensor_parallel_size"):
        degrees = {"tp": engine_cfg.tensor_parallel_size}
    return degrees


def check_layout(cfg: GRPOConfig, engine_cfg: Any) -> None:
    """The engine's TP x PP x CP divides `cluster.train_world_size`, TP the attention heads, PP the layers, EP
    the experts."""
    import json

    degrees = _model_parallel(engine_cfg)
    product = math.prod(degrees.values())
    section = cfg.policy.engine_options_key
    world = cfg.cluster.train_world_size
    if world % product:
        layout = " x ".join(f"{k.upper()}={v}" for k, v in degrees.items())
        raise ConfigError(f"cluster.train_world_size={world} is not a multiple of {section}'s model-parallel size "
                          f"{layout} = {product}; change the parallel sizes in {section} or cluster.train_world_size")
    check_batch_covers_dp(cfg, world // product)
    hf = json.loads((Path(cfg.policy.model_name) / "config.json").read_text())
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads") or heads
    tp = degrees.get("tp", 1)
    if heads and (heads % tp or kv_heads % tp):
        raise ConfigError(f"{section}: tensor parallel size {tp} must divide the model's attention heads ({heads}) "
                          f"and key/value heads ({kv_heads}); choose a divisor of {math.gcd(heads, kv_heads)}")
    # what the engine would otherwise find only once Ray and the workers are up
    layers, pp = hf.get("num_hidden_layers"), degrees.get("pp", 1)
    if layers and layers % pp:
        raise ConfigError(f"{section}: pipeline parallel size {pp} must divide the model's {layers} layers")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    ep = getattr(engine_cfg, "ep", 1)
    if ep > 1 and (not experts or experts % ep):
        raise ConfigError(f"{section}: expert parallel size {ep} must divide the model's experts "
                          f"({experts or 'none: a dense model'})")
    etp = getattr(engine_cfg, "etp", 1)  # megatron: the experts' TP, TP when unset
    expert_ranks = world // product * degrees.get("cp", 1) * tp
    if expert_ranks % (ep * etp):
        raise ConfigError(f"{section}: expert parallel size {ep} x expert tensor parallel size {etp} (unset: the TP "
                          f"size) must divide DP x CP x TP = {expert_ranks} (cluster.train_world_size={world})")


def check_batch_covers_dp(cfg: GRPOConfig, dp: int) -> None:
    """Every DP rank gets a sequence of each optimizer step's batch: an empty shard is no TokenBatch, and the
    run would stop at its first training step, after Ray, generation and the logprob pass."""
    batch = cfg.policy.train_global_batch_size
    if batch < dp:
        raise ConfigError(f"policy.train_global_batch_size={batch} is smaller than the data-parallel size {dp} "
                          f"(cluster.train_world_size / model-parallel size): a DP rank would have no sequence to "
                          f"train on; raise it to at least {dp}")


def check_cluster_address(address: str | None) -> None:
    """A `host:port` cluster address must accept a TCP connection within seconds (else ray.init would hang)."""
    if address in (None, "", "auto", "local"):
        return
    host_port = address.split("://", 1)[-1]
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"cluster.address={address!r} is not host:port (or 'auto'); e.g. 10.0.0.1:6379")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConfigError(f"cluster.address={address!r}: nothing answers at {host}:{port} within "
                          f"{ADDRESS_PROBE_TIMEOUT_S:.0f} s ({exc}); start the cluster there (`ray start --head "
                          f"--port={port}`) or leave cluster.address unset for a local Ray") from None


def check_backend_options(backend_cls: type, kwargs: dict[str, Any]) -> None:
    """`generation.backend_kwargs` values the backend's constructor would refuse, through its optional
    `check_options` classmethod (rollout's README), so that they fail here and not in the generation actor
    after Ray started and the model loaded; after check_kwargs, which has checked names and plain types."""
    check = getattr(backend_cls, "check_options", None)
    if check is None:
        return
    key = "generation.backend_kwargs"
    try:
        check(kwargs, prefix=f"{key}.")
    except (ValueError, TypeError) as exc:
        message = str(exc)  # a hook that ignores `prefix` still gets the section named
        raise ConfigError(message if message.startswith(key) else f"{key}: {message}") from None


def check_backend_installed(cfg: GRPOConfig, backend_cls: type) -> None:
    """A local run's generation backend finds its optional modules (else it fails inside a Ray actor); on a
    cluster the workers' Python is not the driver's, so it is not checked."""
    if cfg.cluster.address:
        return
    for module, install in getattr(backend_cls, "required_modules", {}).items():
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"generation.backend={cfg.generation.backend!r} needs the Python module {module!r}, "
                              f"which this environment lacks: {install}; or set generation.backend=torch")


def check_wandb_installed(wandb: WandbConfig) -> None:
    """logger.wandb.enabled finds wandb (an optional dependency) in the driver, the one process that logs."""
    if wandb.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger.wandb.enabled=true needs the wandb package, which this environment lacks: "
                          "uv sync --extra wandb (pip install wandb outside the workspace); or set "
                          "logger.wandb.enabled=false")


def expand_home(cfg: GRPOConfig) -> GRPOConfig:
    """`~` at the start of a path key is the home directory, as in a shell: the shell leaves `key=~/x` alone (the `~`
    is not at the start of the word), and Python took it for a directory named `~` in the working directory."""
    def home(path: str | None) -> str | None:
        return None if path is None else os.path.expanduser(path)

    policy = dataclasses.replace(cfg.policy, model_name=home(cfg.policy.model_name))
    if policy.megatron_cfg.get("converted_checkpoint_dir"):
        policy = dataclasses.replace(policy, megatron_cfg={
            **policy.megatron_cfg, "converted_checkpoint_dir": home(policy.megatron_cfg["converted_checkpoint_dir"])})
    return dataclasses.replace(
        cfg, policy=policy,
        env=dataclasses.replace(cfg.env, train_data=home(cfg.env.train_data), val_data=home(cfg.env.val_data)),
        logger=dataclasses.replace(cfg.logger, log_dir=home(cfg.logger.log_dir)),
        checkpointing=dataclasses.replace(cfg.checkpointing, dir=home(cfg.checkpointing.dir)))


def resolve_model(cfg: GRPOConfig) -> GRPOConfig:
    name = cfg.policy.model_name
    if name.startswith(TINY_PREFIX):
        from rl_core.testing.tiny_models import ARCHITECTURES, cached_tiny_checkpoint

        arch = name[len(TINY_PREFIX):]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"policy.model_name={name!r}: tiny architectures are {list(ARCHITECTURES)}")
        path = cached_tiny_checkpoint(arch, seed=cfg.grpo.seed)
        logger.info("policy.model_name=%s -> tiny %s checkpoint built locally at %s", name, arch, path)
        name = str(path)
    if name.startswith(SHAPE_PREFIX):
        name = str(cached_shape_checkpoint(name[len(SHAPE_PREFIX):], seed=cfg.grpo.seed))
    if not (Path(name) / "config.json").is_file():
        raise ConfigError(model_dir_problem(name))
    # absolute: Ray workers resolve a relative path in their own working directory (the raylet's), not ours
    name = str(Path(name).absolute())
    policy = dataclasses.replace(cfg.policy, model_name=name)
    cache = policy.megatron_cfg.get("converted_checkpoint_dir")
    if cache:  # the same for the Megatron engine's conversion cache
        policy = dataclasses.replace(policy, megatron_cfg={**policy.megatron_cfg,
                                                           "converted_checkpoint_dir": str(Path(cache).absolute())})
    return dataclasses.replace(cfg, policy=policy)


def model_dir_problem(name: str) -> str:
    """Why `policy.model_name` is no local checkpoint directory: missing, a Hub id (nothing is downloaded), or a
    directory without config.json."""
    path = Path(name).expanduser()
    fix = "point it at a directory saved with save_pretrained, or use tiny:<arch> for a local toy model"
    if not path.exists():
        parts = name.split("/")
        if len(parts) == 2 and all(parts) and not name.startswith((".", "~")):  # e.g. Qwen/Qwen2.5-0.5B
            return (f"policy.model_name={name!r}: no such local directory ({path.absolute()}); the trainer downloads "
                    f"nothing, so a Hugging Face Hub id must be fetched first (hf download {name} --local-dir "
                    f"models/{parts[1]}), then set policy.model_name=models/{parts[1]}")
        return f"policy.model_name={name!r}: no such directory ({path.absolute()}); {fix}"
    if (path / STATE_FILE).is_file() or (path / "checkpoints").is_dir():  # what `eval` users reach for first
        kind = "checkpoint" if (path / STATE_FILE).is_file() else "directory"
        copies = _hf_copies(path)
        use = (f"use its Hugging Face copy, policy.model_name={copies[-1]}" if copies else
               f"write one with `{program_name()} export {name}` and set policy.model_name to the directory it names")
        return f"policy.model_name={name!r} is a trainer's run {kind}, not a Hugging Face model directory: {use}"
    return f"policy.model_name={name!r} is not a local Hugging Face checkpoint directory (no config.json); {fix}"


def _hf_copies(path: Path) -> list[Path]:
    """The Hugging Face copies in a checkpoint (`hf/`) or a run directory (each checkpoint's `hf/`, and `export`'s
    `hf/step_N`), the newest step last."""
    found = [path / HF_DIR, *path.glob(f"checkpoints/step_*/{HF_DIR}"), *path.glob(f"{HF_DIR}/step_*")]

    def step(copy: Path) -> int:  # N of the step_N in checkpoints/step_N/hf or hf/step_N (a checkpoint's hf/: -1)
        return next((int(part[5:]) for part in copy.parts[-2:] if re.fullmatch(r"step_\d+", part)), -1)

    return sorted((p for p in found if (p / "config.json").is_file()), key=step)


def check_environment(cfg: GRPOConfig, *, training: bool = True) -> None:
    """`env.*`: a registered environment whose constructor accepts `env.kwargs`, and prompts to train on (with
    `training=False`, as `eval` runs: validation prompts only, whatever grpo.val_every says)."""
    from rollout.environments import environment_factory, environment_names, toy_prompts
    from rollout.environments.pool import check_pool_options
    from rollout.rewards.toy import TOY_TASKS

    if cfg.env.name not in environment_names():
        near = closest_key(cfg.env.name, environment_names())
        hint = (f"; did you mean env.name={near}?" if near else
                f". env.name is how completions are scored; prompts come from env.train_data: a dataset such as "
                f"{cfg.env.name!r}, if it holds math problems, trains with env.name=math env.train_data={cfg.env.name} "
                "(apps/grpo/README.md, 'Prompts from the Hugging Face Hub')")
        raise ConfigError(f"env.name={cfg.env.name!r} is not known; choose one of {environment_names()}{hint}")
    check_kwargs(environment_factory(cfg.env.name), cfg.env.kwargs, "env.kwargs")
    pool_options = {key: cfg.env.kwargs[key] for key in ("num_workers", "timeout_s", "memory_limit_mb")
                    if key in cfg.env.kwargs}
    try:  # the reward pool's bounds, checked where the pool would find them only after Ray started
        check_pool_options(**pool_options)
    except ValueError as exc:
        raise ConfigError(f"env.kwargs: {exc}") from None
    check_prompt_data(cfg.env, "train")
    check_prompt_data(cfg.env, "val")
    needs_train, needs_val = training, bool(cfg.grpo.val_every) or not training
    if (needs_train and cfg.env.train_data is None) or (needs_val and cfg.env.val_data is None):
        if cfg.env.name not in TOY_TASKS:
            if needs_train and cfg.env.train_data is None:
                raise ConfigError(f"env.name={cfg.env.name!r} has no built-in prompts; set env.train_data and "
                                  "env.val_data to local prompt files or Hugging Face Hub datasets (or "
                                  "grpo.val_every=0 for no validation)")
            if not training:
                raise ConfigError(f"env.name={cfg.env.name!r} has no built-in prompts to evaluate on; set "
                                  "env.val_data to a local prompt file")
            raise ConfigError(f"env.name={cfg.env.name!r} has no built-in prompts to validate on; set env.val_data to "
                              "a local prompt file, or grpo.val_every=0 for no validation")
        check_kwargs(TOY_TASKS[cfg.env.name][0], cfg.env.prompt_kwargs, "env.prompt_kwargs",
                     given=("num", "split", "seed"))
        try:
            toy_prompts(cfg.env.name, 1, **cfg.env.prompt_kwargs)
        except ValueError as exc:
            raise ConfigError(f"env.prompt_kwargs: {exc}") from exc


def check_prompt_data(env: EnvConfig, role: Literal["train", "val"]) -> None:
    """`env.{role}_data` is a prompt dataset rollout reads: for a Hub dataset, its split and subset are there (found
    from its file listing, no data read); a file, one split read whole, leaves them at their defaults (else the run
    would silently train or validate on something other than the split asked for)."""
    from rollout.datasets import is_hub_dataset, prompt_data_problem

    path, split, subset = (getattr(env, f"{role}_{name}") for name in ("data", "split", "subset"))
    if path is None:
        return
    hub = is_hub_dataset(path)
    problem = prompt_data_problem(path, split=split, subset=subset)
    if problem:
        keys = f" (env.{role}_split={split!r}, env.{role}_subset={subset!r})" if hub else ""
        raise ConfigError(f"env.{role}_data={path!r}{keys}: {problem}")
    defaults = {f.name: f.default for f in dataclasses.fields(EnvConfig)}
    for key, value in ((f"{role}_split", split), (f"{role}_subset", subset)):
        if not hub and value != defaults[key]:
            reset = "" if defaults[key] is None else defaults[key]
            raise ConfigError(f"env.{key}={value!r} picks part of a Hugging Face Hub dataset, but env.{role}_data="
                              f"{path!r} is one file (or save_to_disk directory), read whole; set env.{key}={reset} "
                              f"(its default), or point env.{role}_data at the Hub dataset (a name or a directory)")


def check_engine_takes_model(engine_cls: type, policy: PolicyConfig) -> None:
    """An engine that `ChecksModel` (Megatron: the architectures ckpt-convert maps; DTensor: the decoder layers it
    wraps, the modules LoRA adapts) accepts the checkpoint with these settings; else its worker would refuse it
    after Ray and every worker started."""
    if not isinstance(engine_cls, ChecksModel):
        return
    try:
        engine_cls.check_model(policy)
    except ValueError as exc:
        raise ConfigError(f"policy.model_name={policy.model_name!r}: {exc}") from None


def check_backend_takes_model(backend_cls: type, cfg: GRPOConfig) -> None:
    """A generation backend with the optional `check_model` classmethod (the torch backend: its paged decode path,
    attention soft-capping) can generate from the checkpoint with these options; else its actor would refuse it
    after Ray started and the model loaded."""
    check = getattr(backend_cls, "check_model", None)
    if check is None:
        return
    try:
        check(cfg.policy.model_name, cfg.generation.backend_kwargs, prefix="generation.backend_kwargs.")
    except ValueError as exc:
        raise ConfigError(f"policy.model_name={cfg.policy.model_name!r} with generation.backend="
                          f"{cfg.generation.backend!r}: {exc}") from None


def check_reward_function(cfg: GRPOConfig) -> None:
    """`env.kwargs.fn` of the `function` environment is `pkg.module:function` whose top-level module the
    reward workers will find (else a Ray actor fails at startup). Found, not imported: the user's code runs
    only in the sandboxed workers. On a cluster the workers' Python is not the driver's: not checked."""
    fn = cfg.env.kwargs.get("fn")
    if cfg.env.name != "function" or not isinstance(fn, str) or cfg.cluster.address:
        return
    module, sep, attr = fn.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"env.kwargs.fn={fn!r} is not an import path of the form 'pkg.module:function'")
    if module.endswith(".py") or "/" in module:
        stem = Path(module).with_suffix("").name
        raise ConfigError(f"env.kwargs.fn={fn!r} is a file path; it takes an import path 'module:function': start "
                          f"the run in {Path(module).parent or '.'} (or add it to PYTHONPATH) and set "
                          f"env.kwargs.fn={stem}:{attr}")
    top = module.split(".")[0]
    launch_dir = os.getcwd()  # on the workers' import path (rollout._reward_worker)
    spec = importlib.util.find_spec(top) or PathFinder.find_spec(top, [launch_dir])
    if spec is None:
        raise ConfigError(f"env.kwargs.fn={fn!r}: no module {top!r} on the Python path or in {launch_dir}; "
                          "install its package, add its directory to PYTHONPATH, or start the run in the directory "
                          "that holds it")
    for part in module.split(".")[1:]:  # a submodule, found without importing its package (no user code runs here)
        locations = list(spec.submodule_search_locations or [])
        spec = PathFinder.find_spec(part, locations) if locations else None
        if spec is None:
            raise ConfigError(f"env.kwargs.fn={fn!r}: no module {module!r} ({part!r} is not in "
                              f"{locations or 'a package'}); check the import path")
    if spec.origin and spec.origin.endswith(".py"):  # compiled, not run: a typo fails here, not in the reward
        try:                                          # workers once Ray is up
            tree = compile(Path(spec.origin).read_bytes(), spec.origin, "exec", ast.PyCF_ONLY_AST)
        except SyntaxError as exc:
            raise ConfigError(f"env.kwargs.fn={fn!r}: {exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}") from None
        defined = top_level_names(tree)
        if defined is not None and attr not in defined:
            near = closest_key(attr, sorted(defined))
            raise ConfigError(f"env.kwargs.fn={fn!r}: {spec.origin} defines no {attr!r} at its top level"
                              + (f"; did you mean env.kwargs.fn={module}:{near}?" if near else ""))
        for name, lineno in top_level_imports(tree):
            if importlib.util.find_spec(name) is None and PathFinder.find_spec(name, [launch_dir]) is None:
                raise ConfigError(f"env.kwargs.fn={fn!r}: {spec.origin}:{lineno} imports {name!r}, which is not "
                                  "installed (the reward workers would fail to import it): install it, or start the "
                                  "run where it can be imported")


def top_level_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(top-level package, line) of each absolute import a module runs unconditionally (its top level, outside
    try blocks, which may guard an optional import)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], node.lineno))
    return out


def top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module's top level binds (def, class, assignment, import), read from its syntax tree; None where
    it may bind names the tree does not show (`from x import *`, `globals()`, a module `__getattr__`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return None
        if isinstance(node, ast.Name) and node.id == "globals":
            return None
    for node in tree.body:  # the top level, and what its if / try blocks bind
        stack = [node]
        while stack:
            item = stack.pop()
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(item.name)
            elif isinstance(item, ast.Import | ast.ImportFrom):
                names.update((alias.asname or alias.name).split(".")[0] for alias in item.names)
            elif isinstance(item, ast.Assign | ast.AnnAssign | ast.AugAssign | ast.For | ast.With):
                targets = (item.targets if isinstance(item, ast.Assign) else
                           [item.target] if not isinstance(item, ast.With) else
                           [w.optional_vars for w in item.items if w.optional_vars is not None])
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            if isinstance(item, ast.If | ast.Try | ast.For | ast.With | ast.While):
                stack.extend(child for field in ("body", "orelse", "finalbody", "handlers")
                             for child in getattr(item, field, []))
            if isinstance(item, ast.ExceptHandler):
                stack.extend(item.body)
    return None if "__getattr__" in names else names


def check_plugins_reach_workers(cfg: GRPOConfig, engine_cls: type) -> None:
    """The engine implements every abstract method, and the engine and generation backend are known to the trainer's
    Ray workers: a class registered in this process only (`@register_engine`, `@register_generation_backend`) is
    not, since they never import the module that registered it (found as the first worker started, after Ray)."""
    if inspect.isabstract(engine_cls):
        raise ConfigError(f"{cfg.policy.engine_config_key}: {engine_cls.__module__}.{engine_cls.__qualname__} does not "
                          f"implement {sorted(engine_cls.__abstractmethods__)} of rl_core.interfaces.TrainingEngine")
    for registry, name, key in ((ENGINES, cfg.policy.engine_name, cfg.policy.engine_config_key),
                                (GENERATION_BACKENDS, cfg.generation.backend, "generation.backend")):
        if registry.in_process_only(name):
            cls = registry.get(name, config_key=key)
            raise ConfigError(f"{key}: {registry.kind} {name!r} ({cls.__module__}:{cls.__qualname__}) is registered in "
                              "this process only; the trainer's workers are other processes, which never import it: "
                              f"declare it as an entry point of its package ([project.entry-points.\"{registry.group}\"] "
                              f"{name} = \"{cls.__module__}:{cls.__qualname__}\") and install the package")


def preflight(cfg: GRPOConfig, *, training: bool = True) -> GRPOConfig:
    """Validate what the config points at; returns the config with the model path resolved. `training=False`
    (`eval`): the prompts needed are the validation ones only."""
    cfg = expand_home(cfg)
    check_bounds(cfg)
    check_optimizer(cfg.policy.optimizer)
    if training:  # eval logs to no W&B run, and steps no schedule
        check_wandb_installed(cfg.logger.wandb)
        check_schedule(cfg)
        check_checkpointing(cfg)
    check_environment(cfg, training=training)  # these need no engine: found before its imports (seconds)
    check_reward_function(cfg)
    engine_cls = ENGINES.get(cfg.policy.engine_name, config_key=cfg.policy.engine_config_key)
    try:
        engine_cfg = engine_cls.validate_config(cfg.policy) if isinstance(engine_cls, ValidatesConfig) else None
    except ConfigError as exc:  # with the port of a NeMo-RL config's engine sections, if it is one
        sections = {section: getattr(cfg.policy, section) for section in BUILTIN_ENGINE_SECTIONS.values()}
        raise explain_engine_error(exc, sections, GRPOConfig) from None
    backend_cls = GENERATION_BACKENDS.get(cfg.generation.backend, config_key="generation.backend")
    if training:
        check_plugins_reach_workers(cfg, engine_cls)
    check_kwargs(backend_cls, cfg.generation.backend_kwargs, "generation.backend_kwargs", given=("model_path",))
    check_backend_options(backend_cls, cfg.generation.backend_kwargs)
    check_backend_installed(cfg, backend_cls)
    cfg = resolve_model(cfg)
    check_hardware(cfg.cluster, detect_hardware())
    check_model_dir(cfg.policy.model_name)
    if engine_cfg is not None:
        check_layout(cfg, engine_cfg)
    check_engine_takes_model(engine_cls, cfg.policy)
    check_backend_takes_model(backend_cls, cfg)
    check_cluster_address(cfg.cluster.address)
    return cfg
