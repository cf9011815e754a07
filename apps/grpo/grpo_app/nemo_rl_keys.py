"""Configs written for NeMo-RL: what each of its keys is here, said in one error.

A NeMo-RL config brought over failed on one unknown key per run (some thirty for examples/configs/grpo_math_1B.yaml).
The first unknown key of a config in NeMo-RL's names now comes with the whole port: the keys spelled otherwise here,
those that take another value or other keys, those with no counterpart, and the OmegaConf interpolations to write
out. The engine sections (`policy.dtensor_cfg`, `policy.megatron_cfg`) are the engine's to check, next.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from rl_core.config import ConfigError, UnknownKeyError, schema_keys, unknown_keys, with_keys_elsewhere

# NeMo-RL's names for keys spelled otherwise here. A section maps the keys below it that this schema has by the same
# name (policy.generation.top_p -> generation.top_p).
NEMO_RL_KEYS = {
    "grpo.max_num_steps": "grpo.max_steps",
    "grpo.normalize_rewards": "grpo.normalize_std",
    "grpo.use_leave_one_out_baseline": "grpo.leave_one_out",
    "grpo.val_period": "grpo.val_every",
    "grpo.max_val_samples": "grpo.num_val_prompts",
    "grpo.async_grpo.enabled": "grpo.async_rollouts",
    "loss_fn": "loss",
    "loss_fn.reference_policy_kl_penalty": "loss.kl_coef",
    "loss_fn.ratio_clip_min": "loss.eps_low",
    "loss_fn.ratio_clip_max": "loss.eps_high",
    "loss_fn.ratio_clip_c": "loss.dual_clip",
    "loss_fn.sequence_level_importance_ratios": "loss.sequence_level_ratio",
    "loss_fn.use_importance_sampling_correction": "loss.importance.enabled",
    "checkpointing.checkpoint_dir": "checkpointing.dir",
    "checkpointing.metric_name": "checkpointing.metric",
    "checkpointing.save_period": "checkpointing.save_every",
    "policy.generation": "generation",
    "policy.generation.vllm_kwargs": "generation.backend_kwargs",
    "policy.generation.colocated.enabled": "generation.colocated",
    "policy.generation.vllm_cfg.precision": "generation.backend_kwargs.dtype",
    "policy.generation.vllm_cfg.tensor_parallel_size": "generation.backend_kwargs.tensor_parallel_size",
    "policy.generation.vllm_cfg.gpu_memory_utilization": "generation.backend_kwargs.gpu_memory_utilization",
    "policy.generation.vllm_cfg.max_model_len": "generation.backend_kwargs.max_model_len",
    "policy.generation.vllm_cfg.enforce_eager": "generation.backend_kwargs.enforce_eager",
    "logger.wandb_enabled": "logger.wandb.enabled",
    "logger.tensorboard_enabled": "logger.tensorboard",
    "data.dataset_name": "env.train_data",
}

# NeMo-RL keys (or sections) whose setting is another value or other keys here: what to write instead, given the value
NEMO_RL_SETTINGS: dict[str, Callable[[Any], str | None]] = {
    # NeMo-RL's ClippedPGLossFn: a mean over the batch's tokens, or over sequences of their tokens' mean
    "loss_fn.token_level_loss": lambda value: f"loss.agg={'token-mean' if value else 'seq-mean-token-mean'}",
    "policy.max_total_sequence_length": lambda value: (
        f"env.max_prompt_tokens and generation.max_new_tokens (the prompt and the completion are bounded apart here, "
        f"together at most {value})"),
    "policy.scheduler": lambda value: (
        "policy.scheduler.warmup_steps, .decay, .total_steps, .min_lr_ratio (one schedule, not a list of torch "
        "schedulers)") if isinstance(value, list) else None,
    "logger.tensorboard": lambda value: (
        "logger.tensorboard=true|false (a switch here, NeMo-RL's logger.tensorboard_enabled; no TensorBoard options)")
        if isinstance(value, dict) else None,
    "policy.logprob_chunk_size": lambda value: (
        "remove it (the log-softmax is always chunked here: policy.logprob_chunk_tokens)" if value is None else
        "policy.logprob_chunk_tokens (tokens of a whole micro-batch per chunk, not positions of each sequence)"),
    # NeMo-RL's validation reward, by the name this trainer logs it under (another metric is only renamed)
    "checkpointing.metric_name": lambda value: "checkpointing.metric=val/reward_mean" if value == "val_reward" else None,
    # NeMo-RL names each environment's section; here one env section, the environment named by env.name
    "env.math": lambda value: "env.name=math" + (f", env.num_workers={value['num_workers']}" if isinstance(value, dict)
                                                 and "num_workers" in value else ""),
}


def _our_name(dotted: str, known: set[str]) -> str | None:
    """This schema's name for NeMo-RL key `dotted` by NEMO_RL_KEYS' longest prefix, or None when it has none (or when
    `dotted` is a key of this schema already)."""
    prefix = max((k for k in NEMO_RL_KEYS if dotted == k or dotted.startswith(k + ".")), key=len, default=None)
    return None if prefix is None or dotted in known else NEMO_RL_KEYS[prefix] + dotted[len(prefix):]


def nemo_rl_renames(data: dict, schema: type) -> dict[str, str]:
    """The keys of config `data` that are NeMo-RL's names, each with this schema's (innermost keys only)."""
    known = set(schema_keys(schema))
    found = {}
    for dotted in _by_dotted_key(data):
        ours = _our_name(dotted, known)
        if ours and (dotted in NEMO_RL_KEYS or ours in known):
            found[dotted] = ours
    return {k: v for k, v in found.items() if not any(other.startswith(k + ".") for other in found)}


def _by_dotted_key(data: dict, prefix: str = "") -> dict[str, Any]:
    """Every key of `data` at every level, dotted, with its value, each section before its keys."""
    flat = {}
    for key, value in data.items():
        flat[f"{prefix}{key}"] = value
        if isinstance(value, dict):
            flat.update(_by_dotted_key(value, f"{prefix}{key}."))
    return flat


def _nest(flat: dict[str, Any]) -> tuple[dict, list[str]]:
    """`flat` as nested mappings, and the keys that found a value on their way (NeMo-RL's
    policy.generation.colocated.resources under generation.colocated, a switch here): the shallower key wins."""
    nested: dict = {}
    clashes = []
    for dotted in sorted(flat, key=lambda k: k.count(".")):
        *sections, key = dotted.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                clashes.append(dotted)
                break
        else:
            node[key] = copy.deepcopy(flat[dotted])
    return nested, clashes


def _short_value(value: Any) -> str:
    """`value` as YAML writes a scalar; a list or mapping as [...] / {...} (the key names it)."""
    if isinstance(value, (list, dict)):
        return "[...]" if isinstance(value, list) else "{...}" if value else "{}"
    return {True: "true", False: "false", None: "null"}.get(value, str(value))


def port_summary(data: dict, schema: type) -> str:
    """The whole port of NeMo-RL config `data` to `schema`, a line per kind of change (the renames first)."""
    known = set(schema_keys(schema))
    values = _by_dotted_key(data)
    settings = {key: note for key, value in values.items()
                if key in NEMO_RL_SETTINGS and (note := NEMO_RL_SETTINGS[key](value))}
    leaves = {key: value for key, value in values.items() if not (isinstance(value, dict) and value)
              and not any(key == k or key.startswith(k + ".") for k in settings)}
    ours = {key: _our_name(key, known) or key for key in leaves}
    theirs = {name: key for key, name in ours.items()}
    nested, clashes = _nest({ours[k]: leaves[k] for k in ours})
    no_counterpart = [theirs[name] for name in unknown_keys(schema, nested) + clashes]
    interpolations = {key: leaves[key] for key in ours if key not in no_counterpart
                      and isinstance(leaves[key], str) and "${" in leaves[key]}
    renames = {k: v for k, v in nemo_rl_renames(data, schema).items() if k not in settings}
    lines = ["here they are spelled: " + ", ".join(f"{k} -> {v}" for k, v in renames.items())]
    if settings:
        lines.append("set otherwise here: " + "; ".join(f"{k}={_short_value(values[k])} -> {note}"
                                                        for k, note in settings.items()))
    if no_counterpart:
        lines.append("no counterpart here (remove them; every key here: apps/grpo/README.md): "
                     + ", ".join(no_counterpart))
    if interpolations:
        lines.append("OmegaConf interpolations, not read here (write the value): "
                     + ", ".join(f"{k}={v}" for k, v in interpolations.items()))
    return "\n".join(lines)


def explain_unknown_key(exc: UnknownKeyError, data: dict, schema: type) -> ConfigError:
    """`exc` with this schema's name for a NeMo-RL key, else the keys of its name elsewhere in the schema; in a config
    that uses NeMo-RL's names, followed by the whole port (`port_summary`): one error, not one a run."""
    renames = nemo_rl_renames(data, schema)
    ours = renames.get(exc.dotted) or NEMO_RL_KEYS.get(exc.dotted)  # a key, or a section of NeMo-RL's
    exc = UnknownKeyError(exc.path, exc.key, exc.candidates, near=[ours], others=exc.others) if ours \
        else with_keys_elsewhere(exc, schema)
    if not renames:
        return exc
    return ConfigError(f"{exc}. This config uses NeMo-RL's names; {port_summary(data, schema)}")
