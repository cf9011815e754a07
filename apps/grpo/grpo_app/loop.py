"""The GRPO loop: prompts -> completions -> rewards -> advantages -> logprobs -> train -> refit -> log.

`grpo_step` is one step, read top to bottom; `train` is the outer loop with validation and checkpoints.
Variant choices (advantage baseline, std normalisation, KL, aggregation) live in rl_core; this file
only wires them in the order of the algorithm.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import difflib
import functools
import logging
import math
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import grpo_app
from grpo_app.checkpoint import HF_DIR, CheckpointManager, run_identity
from grpo_app.cluster import Workers
from grpo_app.config import GRPOConfig
from grpo_app.metrics_sink import STEP_LOG_KEYS, MetricsSink, format_metrics
from grpo_app.prompts import PromptSource
from rl_core.advantages import grpo_advantages
from rl_core.batch import TokenBatch
from rl_core.filters import dynamic_sampling_keep, overlong_loss_mask
from rl_core.interfaces import Completion, RewardRequest, RewardResult, SamplingParams
from rl_core.losses import ClippedPGLoss
from rollout.datasets import PromptExample
from rollout.environments import check_reward_failures, finite_rewards

logger = logging.getLogger(__name__)


class PhaseTimer:
    """Seconds per phase of one step, and what its rollouts produced over every dynamic sampling round,
    dropped groups included: the tokens (rollout/tokens_per_s divides them by the time of all rounds) and
    the failed reward calls (a prompt whose calls all fail scores 0 throughout: a zero-variance group, dropped)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.generated_tokens = 0
        self.reward_errors = 0

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class SampledStep:
    """One step's scored groups, and the timer of their sampling (which goes on to time the rest of the step)."""

    prompts: list[PromptExample]
    completions: list[Completion]
    rewards: torch.Tensor
    results: list[RewardResult]
    timer: PhaseTimer
    ahead: bool = False  # sampled beside the previous step (grpo.async_rollouts), not on this step's time


class RolloutQueue:
    """Where each step's groups come from.

    On-policy (the default), a step samples its own groups when it starts. With `grpo.async_rollouts`, a step
    also starts sampling the next step's groups on a thread, with the weights it trains from, so generation and
    scoring run while it computes logprobs and trains; its refit waits for that sampling first (`wait`). The
    groups a step trains on are so always exactly one update old, whatever the timing (verl's one-step
    off-policy, NeMo-RL's async GRPO at max_trajectory_age_steps=1), and a run is as reproducible as an
    on-policy one. A checkpoint holds the groups sampled ahead (`ahead_bytes`), so a resumed run trains on the
    very groups the original did.
    """

    def __init__(self, sample: Callable[[int], SampledStep], *, ahead: bool, max_steps: int) -> None:
        self._sample, self.ahead, self.max_steps = sample, ahead, max_steps
        self._ready: tuple[int, SampledStep] | None = None  # sampled ahead, for the step it names
        self._running: tuple[int, threading.Thread, dict[str, Any]] | None = None

    def take(self, step: int) -> SampledStep:
        """`step`'s groups (sampled ahead, or now); with `ahead`, the next step's start sampling."""
        self.wait()
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == step:
            sampled = dataclasses.replace(ready[1], ahead=True)
        else:
            sampled = self._sample(step)
        if self.ahead and step + 1 < self.max_steps:
            self._start(step + 1)
        return sampled

    @property
    def sampling(self) -> bool:
        return self._running is not None

    def wait(self) -> None:
        """Until the groups sampled ahead are complete; raises what their sampling raised."""
        if self._running is None:
            return
        step, thread, box = self._running
        thread.join()
        self._running = None
        if "error" in box:
            raise box["error"]
        self._ready = step, box["sampled"]

    def _start(self, step: int) -> None:
        box: dict[str, Any] = {}

        def sample() -> None:
            try:
                box["sampled"] = self._sample(step)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the loop's thread by wait()
                box["error"] = exc

        # a daemon: a run stopped by a signal must not wait at exit for a sampling it abandoned
        thread = threading.Thread(target=sample, name=f"rollouts-step-{step}", daemon=True)
        thread.start()
        self._running = step, thread, box

    def ahead_bytes(self) -> bytes | None:
        """The groups sampled ahead (after `wait`), pickled for a checkpoint; None if there are none."""
        return None if self._ready is None else pickle.dumps(self._ready)

    def restore(self, checkpoint: Path, step: int) -> None:
        """The groups a checkpoint (of `step`) holds for its next step, if any (a checkpoint of a verified run
        directory: its manifest covers the file). A checkpoint of a run's last step holds none (nothing was sampled
        past the end), nor does an on-policy run's: resumed with `ahead` and a larger grpo.max_steps, `step` samples
        its own groups with the checkpoint's weights, on-policy for that one step (said, not silently inexact)."""
        file = checkpoint / SAMPLED_AHEAD_FILE
        if file.is_file():
            self._ready = pickle.loads(file.read_bytes())  # noqa: S301 - our own checkpoint, verified
            logger.info("resuming with step %d's groups, sampled ahead before the checkpoint", self._ready[0])
        elif self.ahead and step < self.max_steps:
            logger.warning("%s holds no groups sampled ahead (the last step of its run, or an on-policy run): step %d "
                           "samples its own now, with the checkpoint's weights, so its groups are on-policy and not one "
                           "update old as in a run that had not stopped there (the steps after it are one update old again)",
                           checkpoint, step)


SAMPLED_AHEAD_FILE = "sampled_ahead.pkl"
STALLED_STEPS = (10, 100, 1000)  # steps in a row without advantage that NoAdvantageLog warns about again


@dataclass
class NoAdvantageLog:
    """Says when a step trains on nothing but the KL term, or on nothing (every group's completions scored alike: a
    constant reward, a task too hard for the model, or one it now answers the same way every time); the metrics show
    it only as rollout/advantages_abs_mean 0. Warned the first time in a run and when such steps come 10, 100, 1000
    in a row (the run may have stalled); the summary counts them all. Not every time: the default run's converged
    policy repeated the warning at 30 of its last 60 steps."""

    warned: bool = False
    since: int | None = None  # the first step of the run of such steps going on

    def update(self, step: int, rewards: torch.Tensor, advantages: torch.Tensor, kl_coef: float) -> None:
        if bool(advantages.any()):
            self.since = None
            return
        self.since = step if self.since is None else self.since
        trains_on = "nothing but the KL term" if kl_coef else "nothing (loss.kl_coef=0)"
        in_a_row = step - self.since + 1
        if not self.warned:
            self.warned = True
            logger.warning("step %d: every group's completions got the same reward (reward_mean %.4g): all advantages "
                           "are 0, so this step trains on %s; if it persists, check the reward function and the "
                           "task's difficulty (grpo.dynamic_sampling drops such groups). Later steps like it are "
                           "counted in the summary, and said again when 10 come in a row", step,
                           float(rewards.mean()), trains_on)
        elif in_a_row in STALLED_STEPS:
            logger.warning("steps %d-%d: %d in a row without advantage (reward_mean %.4g now), trained on %s: the run "
                           "may have stalled", self.since, step, in_a_row, float(rewards.mean()), trains_on)


@dataclass
class Run:
    """Everything one training run holds; built by build.build_run."""

    cfg: GRPOConfig
    workers: Workers
    tokenizer: Any
    train_prompts: PromptSource
    val_prompts: list[PromptExample]
    sink: MetricsSink
    checkpoints: CheckpointManager | None
    loss_fn: ClippedPGLoss
    rollouts: RolloutQueue = field(init=False)
    no_advantage: NoAdvantageLog = field(default_factory=NoAdvantageLog)

    def __post_init__(self) -> None:
        self.rollouts = RolloutQueue(functools.partial(sample_step, self), ahead=self.cfg.grpo.async_rollouts,
                                     max_steps=self.cfg.grpo.max_steps)


def sampling_params(cfg: GRPOConfig, step: int, *, n: int, greedy: bool = False) -> SamplingParams:
    # The seed depends on the step alone, so a resumed run samples exactly what the original did.
    return SamplingParams(n=n, temperature=0.0 if greedy else cfg.generation.temperature, top_p=cfg.generation.top_p,
                          top_k=cfg.generation.top_k, max_new_tokens=cfg.generation.max_new_tokens,
                          stop_token_ids=[], seed=cfg.grpo.seed * 1_000_003 + step)


def reward_requests(prompts: list[PromptExample], completions: list[Completion], tokenizer: Any) -> list[RewardRequest]:
    """What the environment scores: each completion's text and finish reason with its prompt (as rendered and as chat
    messages) and the prompt's metadata."""
    return [RewardRequest(prompt=prompts[c.prompt_index].prompt, metadata=prompts[c.prompt_index].metadata,
                          messages=prompts[c.prompt_index].messages,
                          completion=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                          finish_reason=c.finish_reason)
            for c in completions]


def rollout(run: Run, prompts: list[PromptExample], params: SamplingParams, timer: PhaseTimer):
    """Generate `params.n` completions per prompt and score them; returns completions, rewards, results.

    Each generator's share is decoded and sent to scoring as soon as it finishes, while the other
    generators still run; the results are put back in prompt order, so nothing depends on which finished
    first. `timing/reward_s` is the scoring left to wait for after the last generator finished.
    """
    scoring = []
    with timer("generate"):
        for part in run.workers.generate_parts([p.prompt_token_ids for p in prompts], params):
            scoring.append((part, run.workers.submit_score(reward_requests(prompts, part, run.tokenizer))))
            timer.generated_tokens += sum(len(c.token_ids) for c in part)
    with timer("reward"):
        scoring.sort(key=lambda item: item[0][0].prompt_index)
        completions = [c for part, _ in scoring for c in part]
        check_completions(completions, len(prompts), params.n, run.cfg.generation.backend)
        # an environment's NaN / inf reward counts as a failed call (scored 0), like a reward function's
        results = finite_rewards([r for _, wait in scoring for r in wait()])
        timer.reward_errors += sum(r.error is not None for r in results)
        check_reward_failures(results, run.cfg.env.max_failed_reward_fraction, "env.max_failed_reward_fraction")
    rewards = torch.tensor([r.reward for r in results], dtype=torch.float32)
    return completions, rewards, results


def check_completions(completions: list[Completion], num_prompts: int, n: int, backend: str) -> None:
    """The generators kept `GenerationBackend.generate`'s contract: `n` completions per prompt, prompt-major, a
    logprob per token; else a group would be scored and trained short, or under another prompt, without a word."""
    where = f"generation backend {backend!r} (generation.backend) broke GenerationBackend.generate's contract:"
    indices = [c.prompt_index for c in completions]
    expected = [i for i in range(num_prompts) for _ in range(n)]
    if indices != expected:
        counts = collections.Counter(indices)
        wrong = next((i for i in range(num_prompts) if counts[i] != n), None)
        raise RuntimeError(f"{where} {len(completions)} completions for {num_prompts} prompts x n={n}"
                           + (f" (prompt {wrong}: {counts[wrong]})" if wrong is not None else ", not prompt-major"))
    for c in completions:
        if len(c.logprobs) != len(c.token_ids):
            raise RuntimeError(f"{where} a completion of prompt {c.prompt_index} has {len(c.token_ids)} tokens and "
                               f"{len(c.logprobs)} logprobs (one per token)")


def build_batch(prompts: list[PromptExample], completions: list[Completion], advantages: torch.Tensor,
                overlong_filtering: bool) -> TokenBatch:
    """Prompt + completion token rows; loss on completion tokens; sampler logprobs aligned to tokens."""
    input_ids, loss_mask, adv, gen = [], [], [], []
    for c, a in zip(completions, advantages.tolist()):
        prompt = prompts[c.prompt_index].prompt_token_ids
        n_prompt, n_total = len(prompt), len(prompt) + len(c.token_ids)
        input_ids.append(torch.tensor(prompt + c.token_ids, dtype=torch.long))
        mask = torch.zeros(n_total)
        mask[n_prompt:] = 1.0
        loss_mask.append(mask)
        adv.append(torch.full((n_total,), a))
        gen.append(torch.cat([torch.zeros(n_prompt), torch.tensor(c.logprobs, dtype=torch.float32)]))
    if overlong_filtering:  # DAPO: a cut-off completion's reward says nothing about its missing end
        loss_mask = overlong_loss_mask(loss_mask, [c.finish_reason == "length" for c in completions])
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, advantages=adv, gen_logprobs=gen)


def sampling_round(step: int, round_: int, max_rounds: int) -> int:
    """What seeds round `round_` of step `step`'s sampling: one number per (step, round), for any number of DAPO
    refill rounds (16 per step kept the seeds of runs with up to 16 rounds as they were)."""
    return step * max(16, max_rounds) + round_


def sample_groups(run: Run, step: int, timer: PhaseTimer):
    """Prompts and their scored groups; with DAPO dynamic sampling, zero-variance groups are refilled."""
    cfg = run.cfg.grpo
    g = cfg.num_generations_per_prompt
    prompts, completions, rewards, results = [], [], [], []
    for round_ in range(cfg.max_dynamic_sampling_rounds if cfg.dynamic_sampling else 1):
        need = cfg.num_prompts_per_step - len(prompts)
        new_prompts = run.train_prompts.next_batch(need)
        params = sampling_params(run.cfg, sampling_round(step, round_, cfg.max_dynamic_sampling_rounds), n=g)
        new_c, new_r, new_res = rollout(run, new_prompts, params, timer)
        keep = torch.ones(len(new_c), dtype=torch.bool)
        if cfg.dynamic_sampling:
            keep = dynamic_sampling_keep(new_r, torch.tensor([c.prompt_index for c in new_c]))
        rows_of: list[list[int]] = [[] for _ in new_prompts]  # before any renumbering below
        for i, c in enumerate(new_c):
            rows_of[c.prompt_index].append(i)
        for prompt, rows in zip(new_prompts, rows_of):
            if not all(keep[i] for i in rows) and round_ < cfg.max_dynamic_sampling_rounds - 1:
                continue
            for i in rows:
                new_c[i].prompt_index = len(prompts)
                completions.append(new_c[i])
                results.append(new_res[i])
            rewards.append(new_r[rows])
            prompts.append(prompt)
        if len(prompts) >= cfg.num_prompts_per_step:
            break
    return prompts, completions, torch.cat(rewards), results


def sample_step(run: Run, step: int) -> SampledStep:
    timer = PhaseTimer()
    prompts, completions, rewards, results = sample_groups(run, step, timer)
    return SampledStep(prompts, completions, rewards, results, timer)


def one_update_per_batch(cfg: GRPOConfig, num_samples: int) -> bool:
    """One optimizer step per batch: the weights that train on it are the ones that would score prev
    logprobs, so the separate logprob pass is skipped (ClippedPGLoss uses its forward's, detached). The
    sampler's weights may still differ (grpo.async_rollouts): loss.importance weighs that gap."""
    return num_samples <= cfg.policy.train_global_batch_size


def grpo_step(run: Run, step: int) -> dict[str, float]:
    cfg, start = run.cfg, time.perf_counter()
    sampled = run.rollouts.take(step)  # with grpo.async_rollouts: sampled while the last step trained
    prompts, completions, rewards, results, timer = (sampled.prompts, sampled.completions, sampled.rewards,
                                                     sampled.results, sampled.timer)
    group_ids = torch.tensor([c.prompt_index for c in completions])
    advantages = grpo_advantages(rewards, group_ids, normalize_std=cfg.grpo.normalize_std,
                                 leave_one_out=cfg.grpo.leave_one_out, batch_normalize=cfg.grpo.batch_normalize,
                                 clip=cfg.grpo.advantage_clip)
    run.no_advantage.update(step, rewards, advantages, cfg.loss.kl_coef)
    batch = build_batch(prompts, completions, advantages, cfg.grpo.overlong_filtering)
    with timer("logprobs"):
        if not one_update_per_batch(run.cfg, len(batch)):  # else the loss takes prev from its own forward
            batch = batch.with_fields(prev_logprobs=run.workers.compute_logprobs(batch))
        if cfg.loss.kl_coef:
            batch = batch.with_fields(ref_logprobs=run.workers.compute_logprobs(batch, reference=True))
    with timer("train"):
        train_metrics = run.workers.train(batch, run.loss_fn)
    if run.rollouts.sampling:  # the next step's groups are of the weights before this update: refit after them
        with timer("rollout_wait"):
            run.rollouts.wait()
    with timer("refit"):
        run.workers.refit()
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    metrics = {f"train/{k}": v for k, v in train_metrics.items()}
    metrics.update(rollout_metrics(rewards, results, completions, lengths, timer))
    metrics["rollout/advantages_abs_mean"] = float(advantages.abs().mean())
    metrics.update({f"timing/{k}_s": v for k, v in timer.seconds.items()})
    metrics["timing/step_s"] = time.perf_counter() - start
    if run.rollouts.ahead:
        metrics["rollout/sampled_ahead"] = float(sampled.ahead)
    return metrics


def rollout_metrics(rewards, results, completions, lengths, timer: PhaseTimer) -> dict[str, float]:
    correct = [r.correct for r in results if r.correct is not None]
    accuracy = {"rollout/accuracy": sum(correct) / len(correct)} if correct else {}  # tasks that judge correctness
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        **accuracy,
        "rollout/reward_errors": float(timer.reward_errors),
        "rollout/gen_len_mean": float(lengths.mean()),
        "rollout/gen_len_max": float(lengths.max()),
        "rollout/truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "rollout/tokens_per_s": timer.generated_tokens / max(timer.seconds.get("generate", 0.0), 1e-9),
    }


def validate(run: Run, step: int) -> dict[str, float]:
    """Greedy completions of the held-out prompts (deterministic, so the curve is not sampling noise), and the
    seconds it took (`timing/val_s`: outside any `timing/step_s`; it goes with the record of its val/* metrics)."""
    start, timer = time.perf_counter(), PhaseTimer()
    _, rewards, results = rollout(run, run.val_prompts, sampling_params(run.cfg, step, n=1, greedy=True), timer)
    correct = [r.correct for r in results if r.correct is not None]
    out = {"val/reward_mean": float(rewards.mean())}
    if correct:
        out["val/accuracy"] = sum(correct) / len(correct)
    logger.info("validation at step %d (%d prompts): %s", step, len(run.val_prompts), format_metrics(out))
    return {**out, "timing/val_s": time.perf_counter() - start}


def trainer_state(run: Run, step: int, metric: float | None) -> dict[str, Any]:
    metric = metric if metric is not None and math.isfinite(metric) else None
    return {"step": step, "prompts": run.train_prompts.state_dict(), "checkpoint_metric": metric,
            "identity": run_identity(run.cfg)}


@dataclass
class StepRecord:
    """A step's metrics, logged once: as its checkpoint is written (before it is published), else after the step."""

    sink: MetricsSink
    step: int
    metrics: dict[str, float]
    logged: bool = False

    def log(self, checkpoint_s: float | None = None) -> None:
        if checkpoint_s is not None:
            self.metrics["timing/checkpoint_s"] = checkpoint_s
        self.logged = True
        self.sink.log(self.step, self.metrics)


def train(run: Run, start_step: int = 0, save_requested: Callable[[], bool] = lambda: False) -> None:
    """The outer loop: validate, step, log, checkpoint. Once `save_requested()` (SIGUSR1: main), a checkpoint
    after the step in progress, and the run stops.

    Validation of step s (the weights after s steps) is logged with step s's record. A checkpoint of step
    s is scored with that same validation, so when one is due the validation runs before it is written
    (and is reused by the next iteration: greedy and seeded by the step, it is what it would compute).
    """
    cfg = run.cfg.grpo
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    # a bar only on a terminal: in a log file (nohup, a batch job) its redraws are one endless line; there, as with
    # logger.progress_bar=false, each step is a log line instead
    show_bar = run.cfg.logger.progress_bar and sys.stderr.isatty()
    bar = tqdm(range(start_step, cfg.max_steps), initial=start_step, total=cfg.max_steps, desc="GRPO",
               disable=not show_bar)
    validated: dict[int, dict[str, float]] = {}

    def validation(step: int) -> dict[str, float]:
        if step not in validated:
            validated.clear()
            validated[step] = validate(run, step)
        return validated[step]

    def due(step: int) -> bool:
        return bool(cfg.val_every) and (step % cfg.val_every == 0 or step == cfg.max_steps) and (
            step > 0 or cfg.val_at_start)

    warned_metric = False

    def save_checkpoint(step: int, step_metrics: dict[str, float], done: bool,
                        log_record: Callable[[float], None]) -> None:
        """The checkpoint of the weights after `step` (scored by their validation, run here if it is due);
        `log_record(seconds)` logs the step's record with the seconds the saving took (`timing/checkpoint_s`,
        without that validation: it is `timing/val_s`) once the checkpoint is written, before it is published."""
        nonlocal warned_metric
        ckpt = run.cfg.checkpointing
        own_val = validation(step + 1) if due(step + 1) else {}  # no validation of its own: no score
        metric = own_val[ckpt.metric] if ckpt.metric in own_val else step_metrics.get(ckpt.metric)
        if own_val and metric is None and ckpt.metric and not warned_metric:
            warned_metric = True  # with a validation at hand every metric exists: the name is wrong
            near = difflib.get_close_matches(ckpt.metric, [*own_val, *step_metrics], n=1)
            logger.warning("checkpointing.metric=%r is not a metric of this run%s: keep-top-k keeps the newest "
                           "checkpoints only", ckpt.metric, f" (did you mean {near[0]!r}?)" if near else "")
        start = time.perf_counter()
        ahead = run.rollouts.ahead_bytes()
        with_hf = ckpt.save_hf == "every" or (ckpt.save_hf == "final" and done)
        saved = run.checkpoints.save(step + 1, run.workers.save_checkpoint, trainer_state(run, step + 1, metric),
                                     files={SAMPLED_AHEAD_FILE: ahead} if ahead is not None else None,
                                     save_hf=run.workers.save_hf if with_hf else None,
                                     before_publish=lambda: log_record(time.perf_counter() - start))
        if with_hf and done:
            logger.info("trained policy as a Hugging Face model (transformers, vLLM): %s", saved / HF_DIR)

    must_save_by = run.cfg.checkpointing.must_save_by_s if run.checkpoints is not None else None
    deadline = None if must_save_by is None else grpo_app.STARTED + must_save_by
    longest = 0.0  # the longest step so far, with its validation and checkpoint: what the next one may take
    warned_signal = False  # SIGUSR1 without checkpointing: said once

    if start_step == cfg.max_steps and cfg.val_every:  # a finished run resumed: the sink dropped its last record
        run.sink.log(start_step, validation(start_step))
    if cfg.async_rollouts:
        logger.info("grpo.async_rollouts: each step's groups are sampled while the step before trains, by the weights "
                    "one update older than those they train (importance-weighted by loss.importance)")
    if one_update_per_batch(run.cfg, cfg.num_prompts_per_step * cfg.num_generations_per_prompt):
        logger.info("one optimizer step per batch: prev logprobs come from the training forward")
    # log lines above the bar, not glued to its end (Ray workers' lines, printed by Ray, still are)
    with logging_redirect_tqdm() if show_bar else contextlib.nullcontext():
        for step in bar:
            began = time.monotonic()
            val = validation(step) if due(step) else {}  # the weights before this step's update
            step_metrics = grpo_step(run, step)
            metrics = {**val, **step_metrics}
            if not show_bar:
                logger.info("step %d (%d of %d): %s", step, step + 1, cfg.max_steps, format_metrics(metrics, STEP_LOG_KEYS))
            bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", loss=f"{metrics.get('train/loss', 0):.2e}")
            done = step + 1 == cfg.max_steps
            longest = max(longest, time.monotonic() - began)
            out_of_time = deadline is not None and not done and time.monotonic() + longest > deadline
            signalled = save_requested() and not done and not warned_signal
            if signalled and run.checkpoints is None:  # nothing to save: stopping would only lose the rest
                logger.warning("SIGUSR1: checkpointing.enabled=false, nothing to save; the run goes on (Ctrl-C or "
                               "SIGTERM stop it)")
                warned_signal, signalled = True, False
            stop_now = out_of_time or signalled
            record = StepRecord(run.sink, step, metrics)
            try:  # the step's record carries its checkpoint's time, and is logged even if the checkpoint fails
                if run.checkpoints is not None and ((step + 1) % run.cfg.checkpointing.save_every == 0 or done
                                                    or stop_now):
                    save_checkpoint(step, step_metrics, done, record.log)
            finally:
                if not record.logged:
                    record.log()
            longest = max(longest, time.monotonic() - began)
            if signalled:
                logger.warning("SIGUSR1: stopping after step %d of %d, saved in %s; the same command resumes from "
                               "there", step + 1, cfg.max_steps, run.checkpoints.root / f"step_{step + 1}")
                break
            if out_of_time:
                logger.warning("checkpointing.must_save_by=%s: stopping after step %d of %d, saved in %s (another step "
                               "might end past it: the longest took %.1f s); the same command resumes from there",
                               run.cfg.checkpointing.must_save_by, step + 1, cfg.max_steps,
                               run.checkpoints.root / f"step_{step + 1}", longest)
                break
            if done and cfg.val_every:  # after the checkpoint's record: W&B takes no step lower than its last
                run.sink.log(step + 1, validation(step + 1))
