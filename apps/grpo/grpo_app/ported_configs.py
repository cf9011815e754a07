"""Configs written for NeMo-RL, verl or TRL: what each of their keys is here, said in one error.

A NeMo-RL config brought over failed on one unknown key per run (some thirty for examples/configs/grpo_math_1B.yaml),
and so did a verl command line (`actor_rollout_ref.actor.optim.lr=1e-6 data.train_batch_size=1024 ...`) and a TRL
`trl grpo --config` YAML (GRPOConfig's flat fields). The first unknown key of a config in any of their names now comes
with the whole port: the keys spelled otherwise here, those that take another value or other keys, those with no
counterpart, and the OmegaConf interpolations to write out. The engine sections (`policy.dtensor_cfg`,
`policy.megatron_cfg`) are the engine's to check, next; NeMo-RL's keys there that no engine here reads are in its
table, and an engine's error about its section comes with their port (`explain_engine_error`).
"""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rl_core.config import (
    ConfigError,
    SequencePackingConfig,
    UnknownKeyError,
    schema_keys,
    unknown_keys,
    with_keys_elsewhere,
)

# A setting: what to write here instead of a key, given its value and the whole config (dotted key -> value), or None
# when the key's rename says it all.
Setting = Callable[[Any, dict[str, Any]], "str | None"]


@dataclass(frozen=True)
class Framework:
    """Another trainer's config names: `keys` its names for keys spelled otherwise here (a section maps the keys below
    it that this schema has by the same name: policy.generation.top_p -> generation.top_p), `settings` its keys (or
    sections) whose setting is another value or other keys here."""

    name: str
    keys: dict[str, str]
    settings: dict[str, Setting]


def _vllm_kwargs(prefix: str, names: dict[str, str]) -> dict[str, str]:
    """`prefix.<theirs>` -> generation.backend_kwargs.<vLLM's keyword> (vllm.LLM's own names)."""
    return {f"{prefix}.{theirs}": f"generation.backend_kwargs.{ours}" for theirs, ours in names.items()}


SEQPACK_ALGORITHMS = typing.get_args(typing.get_type_hints(SequencePackingConfig)["algorithm"])
# NeMo-RL's packing algorithms (nemo_rl/data/packing) by seqpack's names for them
NEMO_RL_PACKERS = {"modified_first_fit_decreasing": "mffd", "first_fit_decreasing": "ffd", "concatenative": "concat"}
NEMO_RL = Framework("NeMo-RL", keys={
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
    "checkpointing.checkpoint_must_save_by": "checkpointing.must_save_by",
    "policy.generation": "generation",
    "policy.generation.vllm_kwargs": "generation.backend_kwargs",
    "policy.generation.colocated.enabled": "generation.colocated",
    **_vllm_kwargs("policy.generation.vllm_cfg", {
        "precision": "dtype", "tensor_parallel_size": "tensor_parallel_size", "max_model_len": "max_model_len",
        "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager"}),
    "logger.wandb_enabled": "logger.wandb.enabled",
    "logger.tensorboard_enabled": "logger.tensorboard",
    "data.dataset_name": "env.train_data",
}, settings={
    # NeMo-RL's ClippedPGLossFn: a mean over the batch's tokens, or over sequences of their tokens' mean
    "loss_fn.token_level_loss": lambda value, _: f"loss.agg={'token-mean' if value else 'seq-mean-token-mean'}",
    "policy.max_total_sequence_length": lambda value, _: (
        f"env.max_prompt_tokens and generation.max_new_tokens (the prompt and the completion are bounded apart here, "
        f"together at most {value})"),
    "policy.scheduler": lambda value, _: (
        "policy.scheduler.warmup_steps, .decay, .total_steps, .min_lr_ratio (one schedule, not a list of torch "
        "schedulers)") if isinstance(value, list) else None,
    "logger.tensorboard": lambda value, _: (
        "logger.tensorboard=true|false (a switch here, NeMo-RL's logger.tensorboard_enabled; no TensorBoard options)")
        if isinstance(value, dict) else None,
    "policy.logprob_chunk_size": lambda value, _: (
        "remove it (the log-softmax is always chunked here: policy.logprob_chunk_tokens)" if value is None else
        "policy.logprob_chunk_tokens (tokens of a whole micro-batch per chunk, not positions of each sequence)"),
    # NeMo-RL's validation reward, by the name this trainer logs it under (another metric is only renamed)
    "checkpointing.metric_name": lambda value, _: "checkpointing.metric=val/reward_mean" if value == "val_reward"
        else None,
    # NeMo-RL names each environment's section; here one env section, the environment named by env.name
    "env.math": lambda value, _: "env.name=math" + (f", env.num_workers={value['num_workers']}"
                                                    if isinstance(value, dict) and "num_workers" in value else ""),
    "grpo.max_num_epochs": lambda value, _: (
        "grpo.max_steps (steps here: epochs x training prompts / grpo.num_prompts_per_step; the prompts repeat, "
        "reshuffled, epoch after epoch)"),
    "grpo.max_rollout_turns": lambda value, _: "nothing to set" if value == 1 else (
        "no counterpart here (single-turn rollouts)"),
    "policy.generation.top_k": lambda value, _: "generation.top_k=0 (off)" if value in (None, -1) else None,
    **{f"policy.generation.{key}": lambda value, _: "nothing to set (a completion ends at the tokenizer's end of "
                                                    "sequence)" if value is None else "no counterpart here"
       for key in ("stop_token_ids", "stop_strings")},
    "data.shuffle": lambda value, _: "nothing to set (the prompts are reshuffled every epoch)" if value else (
        "no counterpart here (the prompts are always reshuffled every epoch)"),
    "data.system_prompt_file": lambda value, _: "nothing to set" if value is None else (
        "env.system_prompt=<the file's text>"),
    "policy.generation_batch_size": lambda value, _: "nothing to set (generation batches continuously here)",
    "policy.sequence_packing.algorithm": lambda value, _: None if value in SEQPACK_ALGORITHMS else (
        f"policy.sequence_packing.algorithm={NEMO_RL_PACKERS[value]}" if value in NEMO_RL_PACKERS else
        f"policy.sequence_packing.algorithm={' or '.join(SEQPACK_ALGORITHMS)} (no {value} here)"),
    **{f"policy.{section}": lambda value, _: "nothing to set (a packed sequence is padded to the multiple the "
                                              "engine's parallelism needs, no more)"
       for section in ("sequence_packing.sequence_length_round", "make_sequence_length_divisible_by")},
    # its engine sections' keys that no engine here reads (each engine checks its own section; explain_engine_error)
    "policy.dtensor_cfg._v2": lambda value, _: "nothing to set (one DTensor engine here)",
    "policy.dtensor_cfg.context_parallel_size": lambda value, _: "nothing to set" if value == 1 else (
        "policy.megatron_cfg.context_parallel_size (context parallelism is the Megatron engine's here)"),
    "policy.dtensor_cfg.custom_parallel_plan": lambda value, _: "nothing to set" if value is None else (
        "no counterpart here (the tensor-parallel plan is engine_dtensor's own, for each supported architecture)"),
    "policy.megatron_cfg.converter_type": lambda value, _: (
        "nothing to set (ckpt-convert reads the architecture from the model's config.json)"),
    "policy.megatron_cfg.empty_unused_memory_level": lambda value, _: "nothing to set",
    "policy.megatron_cfg.defer_fp32_logits": lambda value, _: (
        "nothing to set (half-precision logits, upcast to fp32 in chunks of policy.logprob_chunk_tokens)"),
    "policy.megatron_cfg.freeze_moe_router": lambda value, _: "nothing to set" if not value else (
        "no counterpart here (the router trains with the other weights)"),
    "policy.megatron_cfg.fp8_cfg": lambda value, _: "nothing to set" if not (isinstance(value, dict) and value.get("enabled")) else (
        "no counterpart here (no FP8 training)"),
    **{f"policy.{section}.env_vars": lambda value, _: "nothing to set" if not value else (
        "export them before the command (a local Ray's workers inherit the driver's environment)")
       for section in ("dtensor_cfg", "megatron_cfg")},
})

ACTOR, ROLLOUT = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
# verl's KL estimators (verl/trainer/ppo/core_algos.py kl_penalty) by their k-names
VERL_KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
VERL = Framework("verl", keys={
    "actor_rollout_ref.model.path": "policy.model_name",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "policy.dtensor_cfg.activation_checkpointing",
    f"{ACTOR}.optim.lr": "policy.optimizer.kwargs.lr",
    f"{ACTOR}.optim.weight_decay": "policy.optimizer.kwargs.weight_decay",
    f"{ACTOR}.optim.min_lr_ratio": "policy.scheduler.min_lr_ratio",
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": "policy.train_micro_batch_size",
    f"{ACTOR}.grad_clip": "policy.max_grad_norm",
    f"{ACTOR}.clip_ratio_low": "loss.eps_low",
    f"{ACTOR}.clip_ratio_high": "loss.eps_high",
    f"{ACTOR}.clip_ratio_c": "loss.dual_clip",
    f"{ACTOR}.loss_agg_mode": "loss.agg",
    f"{ACTOR}.fsdp_config.param_offload": "policy.dtensor_cfg.cpu_offload",
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": "policy.logprob_batch_size",
    f"{ROLLOUT}.n": "grpo.num_generations_per_prompt",
    f"{ROLLOUT}.temperature": "generation.temperature",
    f"{ROLLOUT}.top_p": "generation.top_p",
    f"{ROLLOUT}.top_k": "generation.top_k",
    **_vllm_kwargs(ROLLOUT, {
        "tensor_model_parallel_size": "tensor_parallel_size", "gpu_memory_utilization": "gpu_memory_utilization",
        "dtype": "dtype", "enforce_eager": "enforce_eager", "max_model_len": "max_model_len",
        "max_num_seqs": "max_num_seqs", "max_num_batched_tokens": "max_num_batched_tokens",
        "enable_chunked_prefill": "enable_chunked_prefill"}),
    "algorithm.norm_adv_by_std_in_grpo": "grpo.normalize_std",
    "data.train_batch_size": "grpo.num_prompts_per_step",
    "data.max_prompt_length": "env.max_prompt_tokens",
    "data.max_response_length": "generation.max_new_tokens",
    "data.train_files": "env.train_data",
    "data.val_files": "env.val_data",
    "data.prompt_key": "env.prompt_key",
    "trainer.total_training_steps": "grpo.max_steps",
    "trainer.val_before_train": "grpo.val_at_start",
    "trainer.default_local_dir": "checkpointing.dir",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
    "trainer.nnodes": "cluster.num_nodes",
    "trainer.project_name": "logger.wandb.project",
    "trainer.experiment_name": "logger.wandb.name",
    "ray_init.num_cpus": "cluster.num_cpus",
}, settings={
    # verl counts its mini-batch in prompts and multiplies it by rollout.n; here the batch is counted in sequences
    f"{ACTOR}.ppo_mini_batch_size": lambda value, config: (
        f"policy.train_global_batch_size={value * config[f'{ROLLOUT}.n']} (sequences here: prompts x {ROLLOUT}.n)"
        if isinstance(config.get(f"{ROLLOUT}.n"), int) and isinstance(value, int) else
        f"policy.train_global_batch_size=<this x {ROLLOUT}.n> (sequences here, not prompts)"),
    # verl adds the KL loss only with use_kl_loss; here loss.kl_coef > 0 is the switch
    f"{ACTOR}.use_kl_loss": lambda value, config: (
        f"loss.kl_coef={config.get(f'{ACTOR}.kl_loss_coef', 0.001)}" if value else "loss.kl_coef=0 (the default)"),
    f"{ACTOR}.kl_loss_coef": lambda value, config: f"read with {ACTOR}.use_kl_loss (above)"
        if f"{ACTOR}.use_kl_loss" in config else f"loss.kl_coef={value} (with {ACTOR}.use_kl_loss=true in verl)",
    f"{ACTOR}.kl_loss_type": lambda value, _: f"loss.kl_kind={VERL_KL[value]}" if value in VERL_KL else None,
    f"{ACTOR}.clip_ratio": lambda value, _: f"loss.eps_low={value}, loss.eps_high={value}",
    f"{ACTOR}.optim.lr_warmup_steps": lambda value, _: f"policy.scheduler.warmup_steps={max(value, 0)}"
        if isinstance(value, int) else None,
    # FSDP2's CPU offload here moves the parameters, gradients and optimizer state together
    f"{ACTOR}.fsdp_config.optimizer_offload": lambda value, config: f"read with {ACTOR}.fsdp_config.param_offload "
        "(policy.dtensor_cfg.cpu_offload offloads the optimizer state with the parameters)"
        if f"{ACTOR}.fsdp_config.param_offload" in config else f"policy.dtensor_cfg.cpu_offload={_short_value(value)} "
        "(with the parameters and gradients)",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": lambda value, _: (
        "policy.logprob_batch_size (one for the policy's and the reference's logprobs)"),
    # verl's padding-free batches (use_remove_padding) are sequence packing here; its token budgets per GPU are the
    # micro-batches' here, under the section of the batching that is on
    "actor_rollout_ref.model.use_remove_padding": lambda value, _: (
        f"policy.sequence_packing.enabled={_short_value(value)}"),
    f"{ACTOR}.use_dynamic_bsz": lambda value, config: "read with actor_rollout_ref.model.use_remove_padding (above)"
        if config.get("actor_rollout_ref.model.use_remove_padding") else (
            f"policy.dynamic_batching.enabled={_short_value(value)}"),
    f"{ACTOR}.ppo_max_token_len_per_gpu": lambda value, _: (
        "policy.sequence_packing.train_mb_tokens (or policy.dynamic_batching.train_mb_tokens)"),
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": lambda value, _: (
        "policy.sequence_packing.logprob_mb_tokens (or policy.dynamic_batching.logprob_mb_tokens)"),
    f"{ACTOR}.entropy_coeff": lambda value, _: "nothing to set" if value == 0 else (
        "no counterpart here (no entropy bonus in the loss)"),
    "algorithm.use_kl_in_reward": lambda value, _: "nothing to set (the KL is a loss term here: loss.kl_coef)"
        if not value else "no counterpart here (the KL is a loss term here: loss.kl_coef)",
    "trainer.critic_warmup": lambda value, _: "nothing to set (GRPO has no critic)",
    "trainer.max_actor_ckpt_to_keep": lambda value, _: (
        "checkpointing.keep_top_k=<more than the run saves> (verl's null keeps every checkpoint)" if value is None else
        f"checkpointing.keep_top_k={value} (the best {value} by checkpointing.metric, not the newest)"),
    "trainer.val_only": lambda value, _: "nothing to set" if not value else (
        "the eval subcommand instead of a run (uv run apps/grpo eval --config FILE: the validation alone)"),
    "data.filter_overlong_prompts": lambda value, _: (
        "nothing to set (prompts longer than env.max_prompt_tokens are dropped, with a warning)" if value else
        "no counterpart here (prompts longer than env.max_prompt_tokens are always dropped, with a warning)"),
    f"{ROLLOUT}.name": lambda value, _: {"vllm": "generation.backend=vllm", "hf": "generation.backend=torch"}.get(value),
    f"{ROLLOUT}.top_k": lambda value, _: "generation.top_k=0 (0 turns top-k off here)"
        if isinstance(value, int) and value < 0 else None,
    "algorithm.adv_estimator": lambda value, _: {
        "grpo": "nothing to set (the algorithm here is GRPO)",
        "rloo": "grpo.leave_one_out=true, grpo.normalize_std=false"}.get(value),
    "trainer.total_epochs": lambda value, _: (
        "grpo.max_steps (steps here: epochs x training prompts / data.train_batch_size)"),
    "trainer.test_freq": lambda value, _: f"grpo.val_every={value if isinstance(value, int) and value > 0 else 0}",
    "trainer.save_freq": lambda value, _: f"checkpointing.save_every={value}" if isinstance(value, int) and value > 0
        else "checkpointing.enabled=false",
    "trainer.logger": lambda value, _: ", ".join(
        {"wandb": "logger.wandb.enabled=true", "tensorboard": "logger.tensorboard=true"}[name]
        for name in value if name in ("wandb", "tensorboard")) or "nothing to set (metrics.jsonl is always written)"
        if isinstance(value, list) else None,
})


def _trl_batch(value: Any, config: dict[str, Any]) -> str:
    """A TRL step samples per_device_train_batch_size x processes x gradient_accumulation_steps completions (its
    generation batch, by default one optimizer step), num_generations of each prompt; here a step's prompts and its
    optimizer batch are set, not derived."""
    accumulation, generations = config.get("gradient_accumulation_steps", 1), config.get("num_generations", 8)
    note = f"policy.train_micro_batch_size={value}"
    if all(isinstance(v, int) and v > 0 for v in (value, accumulation, generations)):
        note += (f", and on one GPU grpo.num_prompts_per_step={value * accumulation // generations}, "
                 f"policy.train_global_batch_size={value * accumulation} (a TRL step samples and trains on {value} x "
                 f"{accumulation} x <processes> completions, {generations} a prompt)")
    return note


TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean",
                  "dr_grpo": "seq-mean-token-sum"}  # TRL's dr_grpo also divides by max_completion_length
TRL_SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
# TRL's GRPOConfig fields (a flat YAML for `trl grpo --config`, or its command-line arguments)
TRL = Framework("TRL", keys={
    "model_name_or_path": "policy.model_name",
    "dataset_name": "env.train_data",
    "learning_rate": "policy.optimizer.kwargs.lr",
    "weight_decay": "policy.optimizer.kwargs.weight_decay",
    "warmup_steps": "policy.scheduler.warmup_steps",
    "max_grad_norm": "policy.max_grad_norm",
    "num_generations": "grpo.num_generations_per_prompt",
    "max_prompt_length": "env.max_prompt_tokens",
    "max_completion_length": "generation.max_new_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "top_k": "generation.top_k",
    "beta": "loss.kl_coef",
    "epsilon_high": "loss.eps_high",
    "max_steps": "grpo.max_steps",
    "save_steps": "checkpointing.save_every",
    "eval_steps": "grpo.val_every",
    "output_dir": "logger.log_dir",
    "seed": "grpo.seed",
    "gradient_checkpointing": "policy.dtensor_cfg.activation_checkpointing",
    "vllm_gpu_memory_utilization": "generation.backend_kwargs.gpu_memory_utilization",
    "vllm_tensor_parallel_size": "generation.backend_kwargs.tensor_parallel_size",
}, settings={
    "epsilon": lambda value, config: f"loss.eps_low={value}" + ("" if "epsilon_high" in config
                                                                 else f", loss.eps_high={value}"),
    "loss_type": lambda value, _: f"loss.agg={TRL_LOSS_TYPES[value]}" if value in TRL_LOSS_TYPES else None,
    "scale_rewards": lambda value, _: {True: "grpo.normalize_std=true", "group": "grpo.normalize_std=true",
                                       False: "grpo.normalize_std=false", "none": "grpo.normalize_std=false",
                                       "batch": "grpo.normalize_std=false, grpo.batch_normalize=true"}.get(value),
    "use_vllm": lambda value, _: f"generation.backend={'vllm' if value else 'torch'}",
    "vllm_mode": lambda value, _: {"colocate": "generation.colocated=true",
                                   "server": "generation.colocated=false"}.get(value),
    "bf16": lambda value, _: f"policy.precision={'bfloat16' if value else 'float32'}",
    "per_device_train_batch_size": _trl_batch,
    "gradient_accumulation_steps": lambda value, config: "read with per_device_train_batch_size (above)"
        if "per_device_train_batch_size" in config else None,
    "num_iterations": lambda value, _: "nothing to set (one pass over each batch here)" if value == 1 else None,
    "lr_scheduler_type": lambda value, config: f"policy.scheduler.decay={TRL_SCHEDULERS[value]}" + (
        f", policy.scheduler.total_steps={config['max_steps']}" if isinstance(config.get("max_steps"), int)
        and config["max_steps"] > 0 else "") if value in TRL_SCHEDULERS else None,
    "report_to": lambda value, _: ", ".join(
        {"wandb": "logger.wandb.enabled=true", "tensorboard": "logger.tensorboard=true"}[name]
        for name in ([value] if isinstance(value, str) else value or []) if name in ("wandb", "tensorboard"))
        or "nothing to set (metrics.jsonl is always written)",
    "logging_steps": lambda value, _: "nothing to set (every step is logged)",
})

FRAMEWORKS = (NEMO_RL, VERL, TRL)


def _our_name(framework: Framework, dotted: str, known: set[str]) -> str | None:
    """This schema's name for `framework`'s key `dotted` by its keys' longest prefix, or None when it has none (or
    when `dotted` is a key of this schema already)."""
    prefix = max((k for k in framework.keys if dotted == k or dotted.startswith(k + ".")), key=len, default=None)
    return None if prefix is None or dotted in known else framework.keys[prefix] + dotted[len(prefix):]


def renames(framework: Framework, data: dict, schema: type) -> dict[str, str]:
    """The keys of config `data` that are `framework`'s names, each with this schema's (innermost keys only)."""
    known = set(schema_keys(schema))
    found = {}
    for dotted in _by_dotted_key(data):
        ours = _our_name(framework, dotted, known)
        if ours and (dotted in framework.keys or ours in known):
            found[dotted] = ours
    return {k: v for k, v in found.items() if not any(other.startswith(k + ".") for other in found)}


def _settings(framework: Framework, values: dict[str, Any]) -> dict[str, str]:
    """`framework`'s settings that config `values` (every dotted key) has, each with what to write here."""
    return {key: note for key, value in values.items()
            if key in framework.settings and (note := framework.settings[key](value, values))}


def framework_of(data: dict, schema: type) -> Framework | None:
    """The framework whose names config `data` uses the most (renames and settings; NeMo-RL on a tie), or None."""
    values = _by_dotted_key(data)
    uses = [len(renames(f, data, schema)) + len(_settings(f, values)) for f in FRAMEWORKS]
    return FRAMEWORKS[uses.index(max(uses))] if max(uses) else None


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
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def port_summary(framework: Framework, data: dict, schema: type) -> str:
    """The whole port of `framework`'s config `data` to `schema`, a line per kind of change (the renames first)."""
    known = set(schema_keys(schema))
    values = _by_dotted_key(data)
    settings = _settings(framework, values)
    leaves = {key: value for key, value in values.items() if not (isinstance(value, dict) and value)
              and not any(key == k or key.startswith(k + ".") for k in settings)}
    ours = {key: _our_name(framework, key, known) or key for key in leaves}
    theirs = {name: key for key, name in ours.items()}
    nested, clashes = _nest({ours[k]: leaves[k] for k in ours})
    no_counterpart = [theirs[name] for name in unknown_keys(schema, nested) + clashes]
    interpolations = {key: leaves[key] for key in ours if key not in no_counterpart
                      and isinstance(leaves[key], str) and "${" in leaves[key]}
    renamed = {k: v for k, v in renames(framework, data, schema).items() if k not in settings}
    lines = ["here they are spelled: " + ", ".join(f"{k} -> {v}" for k, v in renamed.items())] if renamed else []
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


def explain_engine_error(exc: ConfigError, engine_sections: dict[str, Any], schema: type) -> ConfigError:
    """`exc`, an engine's error about its own section of `policy` (`engine_sections`: each engine section's name and
    mapping), followed by those sections' port where they use another framework's names: the port of the rest of the
    config came with its first unknown key, before the engines checked theirs."""
    data = {"policy": engine_sections}
    framework = framework_of(data, schema)
    if framework is None:
        return exc
    return ConfigError(f"{str(exc).rstrip('.')}. The engine sections use {framework.name}'s names; "
                       f"{port_summary(framework, data, schema)}")


def explain_unknown_key(exc: UnknownKeyError, data: dict, schema: type) -> ConfigError:
    """`exc` with this schema's name for another framework's key, else the keys of its name elsewhere in the schema;
    in a config that uses NeMo-RL's, verl's or TRL's names, followed by the whole port (`port_summary`): one error, not one
    a run."""
    framework = framework_of(data, schema)
    if framework is None:
        return with_keys_elsewhere(exc, schema)
    ours = renames(framework, data, schema).get(exc.dotted) or framework.keys.get(exc.dotted)  # a key, or a section
    exc = UnknownKeyError(exc.path, exc.key, exc.candidates, near=[ours]) if ours else with_keys_elsewhere(
        UnknownKeyError(exc.path, exc.key, exc.candidates), schema)  # its `others` are in the port
    return ConfigError(f"{exc}. This config uses {framework.name}'s names; {port_summary(framework, data, schema)}")
