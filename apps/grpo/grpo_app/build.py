"""Assemble a run from a validated config, and resume it from its latest checkpoint."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_app.checkpoint import (
    POLICY_DIR,
    CheckpointManager,
    DamagedOnLoad,
    ResumePoint,
    check_identity,
    run_identity,
)
from grpo_app.cluster import Workers
from grpo_app.config import GRPOConfig
from grpo_app.loop import Run
from grpo_app.metrics_sink import MetricsSink
from grpo_app.prompts import PromptSource
from rl_core.checkpoint_io import CheckpointError
from rl_core.config import to_dict
from rl_core.losses import ClippedPGLoss
from rollout.datasets import ANSWER, PromptExample, build_examples, load_prompt_dataset
from rollout.environments import prompt_fields, toy_prompts

logger = logging.getLogger(__name__)


def load_prompts(cfg: GRPOConfig, tokenizer: Any, split: str) -> list[PromptExample]:
    """Prompts from env.{train,val}_data (files or Hub datasets), else from the built-in task's generator."""
    env = cfg.env
    path = env.train_data if split == "train" else env.val_data
    render = {"prompt_key": env.prompt_key, "apply_chat_template": env.use_chat_template,
              "system_prompt": env.system_prompt, "answer_key": env.answer_key}
    if path is not None:
        part = ({"split": env.train_split, "subset": env.train_subset} if split == "train"
                else {"split": env.val_split, "subset": env.val_subset})  # of a Hub dataset
        examples = load_prompt_dataset(path, tokenizer, **part, **render)
        check_prompt_fields(examples, env.name, f"env.{split}_data={path}")
    else:
        num = env.num_generated_train_prompts if split == "train" else cfg.grpo.num_val_prompts
        records = toy_prompts(env.name, num, split="train" if split == "train" else "validation",
                              seed=cfg.grpo.seed, **env.prompt_kwargs)
        examples = build_examples(records, tokenizer, **render)
    source = f"{split} ({path or env.name})"
    check_prompt_vocab(examples, model_vocab_size(cfg.policy.model_name), source)
    return drop_long_prompts(examples, *prompt_token_limit(cfg), source)


def prompt_token_limit(cfg: GRPOConfig) -> tuple[int | None, str]:
    """`cfg.prompt_token_limit_and_keys`, and at most the model's context (config.json `max_position_embeddings`)
    less max_new_tokens unless env.max_prompt_tokens is set: a longer sequence is past the positions the model
    was trained on (vLLM refuses it; the torch backend and the engines ran it without a word)."""
    limit, keys = cfg.prompt_token_limit_and_keys
    context = _model_config(cfg.policy.model_name).get("max_position_embeddings")
    new = cfg.generation.max_new_tokens
    if cfg.env.max_prompt_tokens is None and isinstance(context, int) and (limit is None or context - new < limit):
        limit = context - new
        keys = (f"policy.model_name's max_position_embeddings={context} less generation.max_new_tokens={new}; "
                "env.max_prompt_tokens overrides it")
    return limit, keys


def _model_config(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def check_prompt_fields(examples: list[PromptExample], env_name: str, source: str) -> None:
    """Every prompt of a file holds the metadata fields the environment's reward reads (as it registered them:
    `register_environment(prompt_fields=)`): without them every reward call fails, which would stop the run
    only after Ray, the workers and the first generation."""
    for field, meaning in prompt_fields(env_name).items():
        for number, example in enumerate(examples, start=1):
            if example.metadata.get(field) is None:  # `datasets` fills a field that other rows have with None
                fields = sorted(k for k, v in example.metadata.items() if v is not None)
                fix = " or set env.answer_key to the one that holds it" if field == ANSWER else ""
                raise ValueError(f"{source}: prompt {number} has no {field!r} field, which env.name={env_name} reads "
                                 f"({meaning}); its other fields are {fields}: name that field {field!r} in the file"
                                 f"{fix}")


def model_vocab_size(model_dir: str) -> int | None:
    """`vocab_size` of the checkpoint's config.json (None where it has none at the top level)."""
    return _model_config(model_dir).get("vocab_size")


def check_prompt_vocab(examples: list[PromptExample], vocab_size: int | None, source: str) -> None:
    """Every prompt token has a row in the model's embedding; a tokenizer of a larger vocabulary (not the
    model's own) would otherwise fail in the generator, after Ray and every worker started."""
    if vocab_size is None:
        return
    for number, example in enumerate(examples, start=1):
        if example.prompt_token_ids and max(example.prompt_token_ids) >= vocab_size:
            outside = sorted({t for t in example.prompt_token_ids if t >= vocab_size})
            raise ValueError(f"{source} prompt {number} has token ids {outside[:5]} >= the model's vocab_size "
                             f"{vocab_size} (policy.model_name's config.json): the tokenizer in that directory "
                             "is not the model's")


def drop_long_prompts(examples: list[PromptExample], limit: int | None, keys: str, source: str
                      ) -> list[PromptExample]:
    """The prompts of at most `limit` tokens (set by config `keys`): a longer one would fail in vLLM (or stop
    short of max_new_tokens, reported as a length cut-off) or not fit a micro-batch later."""
    if limit is None:
        return examples
    if limit < 1:  # max_new_tokens alone fills the model's context
        raise ValueError(f"no prompt fits: the prompt-length limit is {limit} tokens ({keys}); lower "
                         "generation.max_new_tokens below the model's context")
    kept = [e for e in examples if len(e.prompt_token_ids) <= limit]
    if not kept:
        raise ValueError(f"every {source} prompt is longer than {limit} tokens ({keys}); raise that limit")
    if len(kept) < len(examples):
        longest = max(len(e.prompt_token_ids) for e in examples)
        logger.warning("dropped %d of %d %s prompts longer than %d tokens (the longest: %d; the limit is %s)",
                       len(examples) - len(kept), len(examples), source, limit, longest, keys)
    return kept


@dataclass
class RunInputs:
    """What a run reads before any worker starts: the tokenizer and both prompt sets."""

    tokenizer: Any
    train: PromptSource
    val: list[PromptExample]


def load_inputs(cfg: GRPOConfig) -> RunInputs:
    """Tokenizer and prompts; a missing file, malformed line or empty set fails here, before Ray starts."""
    tokenizer = load_tokenizer(cfg.policy.model_name)
    examples = load_prompts(cfg, tokenizer, "train")
    if len(examples) < cfg.grpo.num_prompts_per_step:
        logger.warning("the train set has %d prompts, fewer than grpo.num_prompts_per_step=%d: every step repeats "
                       "prompts (groups of one prompt twice in a step)", len(examples), cfg.grpo.num_prompts_per_step)
    train = PromptSource(examples, cfg.grpo.seed)
    if not cfg.grpo.val_every:  # no validation: a task without built-in prompts needs no env.val_data
        return RunInputs(tokenizer=tokenizer, train=train, val=[])
    return RunInputs(tokenizer=tokenizer, train=train, val=load_val_prompts(cfg, tokenizer))


def load_tokenizer(model_dir: str) -> Any:
    """The model's tokenizer; a damaged tokenizer file (a truncated tokenizer.json: transformers' bare 'Expecting
    value: line 1 column 1') is a ValueError naming the directory and the fix."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise ValueError(f"policy.model_name={model_dir!r}: its tokenizer does not load ({type(exc).__name__}: "
                         f"{str(exc)[:300]}); re-save it next to the weights with tokenizer.save_pretrained(dir)") from None


def load_val_prompts(cfg: GRPOConfig, tokenizer: Any) -> list[PromptExample]:
    """The first grpo.num_val_prompts validation prompts: what the trainer validates on and `eval` scores (which
    reads no train prompts: a large env.train_data would be tokenised for nothing)."""
    val = load_prompts(cfg, tokenizer, "val")[: cfg.grpo.num_val_prompts]
    if not val:
        raise ValueError("the validation prompt set is empty: set env.val_data or grpo.val_every=0")
    return val


def checkpoint_manager(cfg: GRPOConfig) -> CheckpointManager | None:
    if not cfg.checkpointing.enabled:
        return None
    return CheckpointManager(cfg.checkpoint_dir, keep_top_k=cfg.checkpointing.keep_top_k,
                             metric=cfg.checkpointing.metric, higher_is_better=cfg.checkpointing.higher_is_better)


def find_resume_point(cfg: GRPOConfig, known_damaged: Mapping[Path, str] | None = None) -> ResumePoint | None:
    """The newest intact checkpoint of this run directory, checked against the config (before Ray starts);
    `known_damaged`: those an engine found damaged as it loaded them (`DamagedOnLoad`), passed over.

    CheckpointError when checkpoints exist but none verifies, or when the config changed the model, the
    engine layout or the task (unless checkpointing.allow_config_change).
    """
    checkpoints = checkpoint_manager(cfg)
    if checkpoints is None:
        _refuse_to_start_over_a_checkpointed_run(cfg)
    point = checkpoints.newest_intact(known_damaged) if checkpoints is not None else None
    if point is not None:
        check_identity(point, run_identity(cfg), allow_change=cfg.checkpointing.allow_config_change)
        if point.step > cfg.grpo.max_steps:  # resuming would rewrite the run's logs and train nothing
            raise CheckpointError(f"{point.path} is at step {point.step}, past grpo.max_steps={cfg.grpo.max_steps}: "
                                  f"set grpo.max_steps >= {point.step} to continue this run, or a new "
                                  "logger.log_dir to start another")
        if point.step < cfg.grpo.max_steps:  # more checkpoints to come
            checkpoints.warn_if_no_room(point.path)
    return point


def _refuse_to_start_over_a_checkpointed_run(cfg: GRPOConfig) -> None:
    """checkpointing.enabled=false on a run directory with checkpoints would start at step 0 and rewrite the run's
    metrics.jsonl and TensorBoard events: its history, and the records a later resume from those checkpoints keeps."""
    listed = CheckpointManager(cfg.checkpoint_dir, keep_top_k=1, metric="", higher_is_better=True).steps()
    if listed:
        raise CheckpointError(
            f"checkpointing.enabled=false, but {cfg.checkpoint_dir} holds checkpoints of a run (step_{listed[-1]} the "
            f"newest): starting over would rewrite the metrics in {cfg.logger.log_dir}. Set checkpointing.enabled=true "
            "to resume it, or another logger.log_dir for a new run")


def build_run(cfg: GRPOConfig, inputs: RunInputs, resume_point: ResumePoint | None = None) -> Run:
    """The workers (on the Ray that main.run_training started), the metrics sink and the checkpoint manager."""
    sink = MetricsSink(cfg.logger.log_dir, tensorboard=cfg.logger.tensorboard,
                       resume_step=resume_point.step if resume_point is not None else None)
    sink.start_wandb(cfg.logger.wandb, to_dict(cfg))  # before the workers: a W&B login problem costs seconds
    checkpoints = checkpoint_manager(cfg)
    workers = Workers(cfg)
    return Run(cfg=cfg, workers=workers, tokenizer=inputs.tokenizer, train_prompts=inputs.train,
               val_prompts=inputs.val, sink=sink, checkpoints=checkpoints, loss_fn=ClippedPGLoss(cfg.loss))


def resume(run: Run, point: ResumePoint | None) -> int:
    """Load the verified checkpoint, if any, and push its weights to the generators; returns the step."""
    if point is None:  # generators loaded the same checkpoint as the policy: nothing to refit yet
        return 0
    try:
        run.workers.load_checkpoint(str(point.path / POLICY_DIR))
    except CheckpointError as exc:  # the engine's own hashes (the driver checked their sizes only); a Ray error
        raise DamagedOnLoad(point.path, str(getattr(exc, "cause", exc))) from exc  # that is one, by its cause
    run.train_prompts.load_state_dict(point.state["prompts"])
    run.rollouts.restore(point.path, point.step)
    run.workers.refit()
    logger.info("resumed from %s at step %d", point.path, point.step)
    return point.step
