"""Assemble a run from a validated config, and resume it from its latest checkpoint."""

from __future__ import annotations

import logging

from grpo_app.checkpoint import CheckpointManager
from grpo_app.cluster import Workers, start_ray
from grpo_app.config import GRPOConfig
from grpo_app.loop import Run
from grpo_app.metrics_sink import MetricsSink
from grpo_app.prompts import PromptSource, tokenize_records
from rl_core.losses import ClippedPGLoss

logger = logging.getLogger(__name__)


def load_records(cfg: GRPOConfig, split: str) -> list[dict]:
    """Prompt records from env.{train,val}_data files, else from the environment's own generator."""
    from rollout import environment_prompts, load_prompt_records

    path = cfg.env.train_data if split == "train" else cfg.env.val_data
    if path is not None:
        return load_prompt_records(path)
    n = cfg.grpo.num_val_prompts if split == "val" else None
    return environment_prompts(cfg.env.name, split=split, num=n, seed=cfg.grpo.seed, **cfg.env.kwargs)


def build_run(cfg: GRPOConfig) -> Run:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    chat = cfg.env.use_chat_template
    train_items = tokenize_records(load_records(cfg, "train"), tokenizer, use_chat_template=chat)
    val_items = tokenize_records(load_records(cfg, "val"), tokenizer, use_chat_template=chat)
    if not val_items and cfg.grpo.val_every:
        raise ValueError("the validation prompt set is empty: set env.val_data or grpo.val_every=0")
    checkpoints = None
    if cfg.checkpointing.enabled:
        checkpoints = CheckpointManager(cfg.checkpoint_dir, keep_top_k=cfg.checkpointing.keep_top_k,
                                        metric=cfg.checkpointing.metric,
                                        higher_is_better=cfg.checkpointing.higher_is_better)
    resuming = checkpoints is not None and checkpoints.latest() is not None
    sink = MetricsSink(cfg.logger.log_dir, tensorboard=cfg.logger.tensorboard, resume=resuming)
    start_ray(cfg)
    workers = Workers(cfg)
    return Run(cfg=cfg, workers=workers, tokenizer=tokenizer, train_prompts=PromptSource(train_items, cfg.grpo.seed),
               val_prompts=val_items[: cfg.grpo.num_val_prompts], sink=sink, checkpoints=checkpoints,
               loss_fn=ClippedPGLoss(cfg.loss))


def resume(run: Run) -> int:
    """Load the latest checkpoint if there is one and push its weights to the generators; returns the step."""
    latest = run.checkpoints.latest() if run.checkpoints is not None else None
    if latest is None:  # generators loaded the same checkpoint as the policy: nothing to refit yet
        return 0
    state = run.checkpoints.load_state(latest)
    run.workers.load_checkpoint(str(latest / "policy"))
    run.train_prompts.load_state_dict(state["prompts"])
    run.sink.truncate(state["step"] - 1)
    run.workers.refit()
    logger.info("resumed from %s at step %d", latest, state["step"])
    return state["step"]
