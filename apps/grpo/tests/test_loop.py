"""The loop's data plumbing with stand-in workers: batch layout, DAPO dynamic sampling refills, when the
separate prev-logprob pass runs, and the rollouts sampled ahead with grpo.async_rollouts."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
import torch

import grpo_app.loop as loop
from grpo_app.build import resume
from grpo_app.checkpoint import CheckpointManager, ResumePoint
from grpo_app.config import load_config
from grpo_app.loop import (
    PhaseTimer,
    Run,
    build_batch,
    grpo_step,
    rollout,
    rollout_metrics,
    sample_groups,
    sampling_params,
)
from grpo_app.metrics_sink import MetricsSink
from grpo_app.prompts import PromptSource
from rl_core.config import ConfigError
from rl_core.interfaces import Completion, RewardRequest, RewardResult
from rollout.datasets import PromptExample
from rollout.environments import RewardFailureError


class StubWorkers:
    """Prompt i's completions all score `rewards[i]` unless i is odd: then they differ (non-zero variance)."""

    def generate(self, prompts, params):
        return [Completion(prompt_index=i, token_ids=[p[0], 9, 2][: 1 + k % 3], logprobs=[-0.5] * (1 + k % 3),
                           finish_reason="stop") for i, p in enumerate(prompts) for k in range(params.n)]

    def score(self, requests):
        return [RewardResult(reward=float(r.metadata["odd"]) * (k % 2)) for k, r in enumerate(requests)]

    def generate_parts(self, prompts, params):
        """Like two generators whose second share finishes first: parts come out of prompt order."""
        completions = self.generate(prompts, params)
        cut = len(prompts) // 2 * params.n  # an even cut: the stub's scores depend on the position mod 2
        for part in (p for p in (completions[cut:], completions[:cut]) if p):  # as Workers: no empty parts
            self.events.append("part ready")
            yield part

    def submit_score(self, requests):
        self.events.append("scoring")
        return lambda: self.score(requests)

    def __init__(self):
        self.logprob_calls, self.trained, self.events = [], [], []

    def compute_logprobs(self, batch, reference=False):
        self.logprob_calls.append(reference)
        return [torch.zeros(len(ids)) for ids in batch.input_ids]

    def train(self, batch, loss_fn):
        self.trained.append(batch)
        return {"loss": 0.0}

    def refit(self):
        return 0


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def make_run(*overrides: str) -> Run:
    cfg = load_config(None, ["grpo.num_prompts_per_step=3", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=6", "policy.model_name=unused", *overrides])
    items = [PromptExample(prompt=str(i), prompt_token_ids=[10 + i, 11], metadata={"odd": i % 2}) for i in range(12)]
    return Run(cfg=cfg, workers=StubWorkers(), tokenizer=StubTokenizer(), train_prompts=PromptSource(items, 0),
               val_prompts=[], sink=None, checkpoints=None, loss_fn=None)


def test_dynamic_sampling_refills_with_groups_that_have_variance():
    run = make_run("grpo.dynamic_sampling=true", "grpo.max_dynamic_sampling_rounds=20")
    prompts, completions, rewards, _ = sample_groups(run, 0, PhaseTimer())
    assert len(prompts) == 3 and all(p.metadata["odd"] == 1 for p in prompts)
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2]
    assert rewards.tolist() == [0.0, 1.0] * 3


def test_every_sampling_round_of_every_step_has_a_seed_of_its_own():
    """Groups that never have variance: every one of 20 refill rounds samples, in steps 0 and 1. Each (step, round)
    drew with another seed; step 0's round 16 once drew with step 1's round 0 seed."""
    run = make_run("grpo.dynamic_sampling=true", "grpo.max_dynamic_sampling_rounds=20")
    seeds = []
    generate = run.workers.generate

    def recording(prompts, params):
        seeds.append(params.seed)
        return generate(prompts, params)

    run.workers.generate = recording
    run.workers.score = lambda requests: [RewardResult(reward=1.0) for _ in requests]  # no group has variance
    for step in (0, 1):
        sample_groups(run, step, PhaseTimer())
    assert len(seeds) == 40 and len(set(seeds)) == 40, seeds


def test_dynamic_sampling_keeps_each_completion_under_its_own_prompt():
    """Round 0 keeps one group of four, round 1 all three of its new ones: 4 groups of 2, each completion (whose
    first token is its prompt's) under its own prompt. The renumbering of kept groups once matched a later
    prompt of the same round: 28 sequences for 16, samples trained under another prompt."""
    cfg = load_config(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=2",
                             "policy.train_global_batch_size=8", "policy.model_name=unused",
                             "grpo.dynamic_sampling=true", "grpo.max_dynamic_sampling_rounds=4"])
    items = [PromptExample(prompt=str(i), prompt_token_ids=[10 + i, 11], metadata={}) for i in range(8)]
    source = PromptSource(items, 0)
    drawn = [items[i] for i in source._order]  # in the order the rounds draw them
    for item, odd in zip(drawn, [0, 1, 0, 0, 1, 1, 1, 0]):  # the stub's groups have variance where odd
        item.metadata["odd"] = odd
    run = Run(cfg=cfg, workers=StubWorkers(), tokenizer=StubTokenizer(), train_prompts=source, val_prompts=[],
              sink=None, checkpoints=None, loss_fn=None)
    prompts, completions, rewards, results = sample_groups(run, 0, PhaseTimer())
    assert prompts == [drawn[1], drawn[4], drawn[5], drawn[6]]
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(c.token_ids[0] == prompts[c.prompt_index].prompt_token_ids[0] for c in completions)
    assert len(rewards) == len(results) == 8


def test_a_generator_that_breaks_the_generate_contract_stops_the_step():
    """A plug-in backend returning a short group, or a logprob fewer than tokens: an error naming the backend (a
    short group trained silently on 15 sequences for 16)."""
    from grpo_app.loop import check_completions

    def group(i, n=2, tokens=2, logprobs=2):
        return [Completion(prompt_index=i, token_ids=[5] * tokens, logprobs=[-1.0] * logprobs, finish_reason="stop")
                for _ in range(n)]

    check_completions(group(0) + group(1), 2, 2, "mygen")
    with pytest.raises(RuntimeError, match=r"generation backend 'mygen' \(generation.backend\) broke GenerationBackend"
                                           r".generate's contract: 3 completions for 2 prompts x n=2 \(prompt 1: 1\)"):
        check_completions(group(0) + group(1, n=1), 2, 2, "mygen")
    with pytest.raises(RuntimeError, match="not prompt-major"):
        check_completions(group(1) + group(0), 2, 2, "mygen")
    with pytest.raises(RuntimeError, match="a completion of prompt 1 has 2 tokens and 1 logprobs"):
        check_completions(group(0) + group(1, logprobs=1), 2, 2, "mygen")


def test_without_dynamic_sampling_every_group_is_kept():
    prompts, completions, rewards, _ = sample_groups(make_run(), 0, PhaseTimer())
    assert len({p.prompt for p in prompts}) == 3  # three different prompts of the source
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2]
    # zero-variance groups (even prompts) kept: each group's rewards are the stub's for that prompt
    assert rewards.tolist() == [float(prompts[c.prompt_index].metadata["odd"]) * (k % 2)
                                for k, c in enumerate(completions)]


def test_batch_rows_masks_and_logprobs_are_aligned():
    prompts = [PromptExample(prompt="a", prompt_token_ids=[5, 6, 7])]
    completions = [Completion(prompt_index=0, token_ids=[8, 2], logprobs=[-0.1, -0.2], finish_reason="stop"),
                   Completion(prompt_index=0, token_ids=[8, 8, 8], logprobs=[-1.0] * 3, finish_reason="length")]
    batch = build_batch(prompts, completions, torch.tensor([1.5, -1.5]), overlong_filtering=True)
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 2]
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1]
    assert torch.allclose(batch.gen_logprobs[0], torch.tensor([0, 0, 0, -0.1, -0.2]))
    assert batch.advantages[0].tolist() == [1.5] * 5
    assert batch.loss_mask[1].sum() == 0  # truncated and overlong filtering is on: no loss


def test_reward_requests_carry_the_prompt_as_rendered_and_as_messages():
    """An environment gets the policy's text, its finish reason, the row's metadata and the chat messages (a reward
    model with its own chat template renders those), each completion with its own prompt's."""
    from rl_core.testing.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    messages = [[{"role": "user", "content": q}] for q in ("ab", "cd")]
    prompts = [PromptExample(prompt=f"user: {m[0]['content']}\n", prompt_token_ids=[5], metadata={"i": i},
                             messages=m) for i, m in enumerate(messages)]
    completions = [Completion(prompt_index=i, token_ids=tokenizer.encode("xy", add_special_tokens=False),
                              logprobs=[0.0, 0.0], finish_reason=reason) for i, reason in ((1, "stop"), (0, "length"))]
    requests = loop.reward_requests(prompts, completions, tokenizer)
    assert [(r.prompt, r.completion, r.metadata, r.messages, r.finish_reason) for r in requests] == [
        ("user: cd\n", "xy", {"i": 1}, messages[1], "stop"), ("user: ab\n", "xy", {"i": 0}, messages[0], "length")]


def test_prev_logprob_pass_runs_only_with_several_optimizer_steps_per_batch():
    on_policy = make_run()  # 6 samples, train_global_batch_size 6: one optimizer step
    grpo_step(on_policy, 0)
    assert on_policy.workers.logprob_calls == [True]  # the reference's (cpu_default's loss.kl_coef), no prev pass
    assert on_policy.workers.trained[0].prev_logprobs is None
    without_kl = make_run("loss.kl_coef=0")
    grpo_step(without_kl, 0)
    assert without_kl.workers.logprob_calls == []
    off_policy = make_run("policy.train_global_batch_size=2", "loss.kl_coef=0.1")  # 3 steps: weights move
    grpo_step(off_policy, 0)
    assert off_policy.workers.logprob_calls == [False, True]  # prev, then the reference
    trained = off_policy.workers.trained[0]  # the stub's logprob pass returns zeros: those are prev and ref
    assert [t.tolist() for t in trained.prev_logprobs] == [[0.0] * len(ids) for ids in trained.input_ids]
    assert [t.tolist() for t in trained.ref_logprobs] == [[0.0] * len(ids) for ids in trained.input_ids]


def test_scoring_overlaps_generation_and_changes_no_result():
    """Scoring starts after the first share finishes (before the second); the result equals the sequential
    path computed here from the stub directly (generate everything, then score everything)."""
    run = make_run()
    prompts = run.train_prompts.next_batch(3)
    params = sampling_params(run.cfg, 0, n=2)
    completions, rewards, results = rollout(run, prompts, params, PhaseTimer())
    assert run.workers.events == ["part ready", "scoring", "part ready", "scoring"]
    stub = StubWorkers()
    expected = stub.generate([p.prompt_token_ids for p in prompts], params)
    expected_results = stub.score([RewardRequest(prompt=prompts[c.prompt_index].prompt,
                                                 metadata=prompts[c.prompt_index].metadata,
                                                 completion="x" * len(c.token_ids)) for c in expected])
    assert [(c.prompt_index, c.token_ids) for c in completions] == [(c.prompt_index, c.token_ids) for c in expected]
    assert rewards.tolist() == [r.reward for r in expected_results] and results == expected_results


def test_accuracy_is_logged_only_where_the_task_judges_correctness():
    completions = [Completion(prompt_index=0, token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop"),
                   Completion(prompt_index=0, token_ids=[3], logprobs=[-0.3], finish_reason="length")]
    lengths = torch.tensor([2.0, 1.0])
    judged = rollout_metrics(torch.tensor([1.0, 0.0]), [RewardResult(reward=1.0, correct=True), RewardResult(reward=0.0, correct=False)],
                             completions, lengths, PhaseTimer())
    assert judged["rollout/accuracy"] == 0.5 and judged["rollout/truncated_fraction"] == 0.5
    partial = rollout_metrics(torch.tensor([0.5, 0.25]), [RewardResult(reward=0.5), RewardResult(reward=0.25)], completions, lengths,
                              PhaseTimer())
    assert "rollout/accuracy" not in partial and partial["rollout/reward_mean"] == 0.375  # repeat_char: no NaN logged


class NonFiniteRewardWorkers(StubWorkers):
    """An environment (not a reward function) that scores each group's first completion NaN or inf."""

    def score(self, requests):
        bad = [float("nan"), float("inf"), float("-inf")]
        return [RewardResult(reward=bad[k // 3 % 3] if k % 3 == 0 else float(k % 3)) for k in range(len(requests))]


def test_non_finite_reward_of_an_environment_scores_zero_as_a_failed_call():
    """One NaN reward must not make its group's advantages NaN (and the step's loss, so the step is skipped):
    it scores 0 and counts as an error. Reference: GRPO advantages in float64 over rewards with 0 in its place."""
    run = make_run("grpo.num_generations_per_prompt=3", "policy.train_global_batch_size=9")
    run.workers = NonFiniteRewardWorkers()
    metrics = grpo_step(run, 0)
    trained = run.workers.trained[0]
    got = [float(adv[0]) for adv in trained.advantages]
    rewards = [0.0, 1.0, 2.0]  # every group's: the non-finite first reward scored 0
    mean = sum(rewards) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)
    assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards] * 3, rel=1e-6)
    assert metrics["rollout/reward_errors"] == 3.0


def test_an_environment_whose_rewards_are_all_non_finite_stops_the_run():
    class AllNaN(StubWorkers):
        def score(self, requests):
            return [RewardResult(reward=float("nan")) for _ in requests]

    run = make_run()
    run.workers = AllNaN()
    with pytest.raises(RewardFailureError, match="non-finite reward nan"):
        grpo_step(run, 0)



class RecordingWorkers(StubWorkers):
    """StubWorkers whose reward calls fail for every completion of an even prompt (a zero-variance group that
    dynamic sampling drops), keeping what they generate and the failures they return: the independent counts."""

    def __init__(self):
        super().__init__()
        self.generated, self.failed = [], 0

    def generate(self, prompts, params):
        completions = super().generate(prompts, params)
        self.generated += completions
        return completions

    def score(self, requests):
        results = [RewardResult(reward=0.0, error="boom") if r.metadata["odd"] == 0 else ok
                   for r, ok in zip(requests, super().score(requests))]
        self.failed += sum(r.error is not None for r in results)
        return results


def test_rollout_counts_cover_the_groups_dynamic_sampling_dropped():
    """timing/generate_s covers every round, so tokens_per_s must count the tokens of the dropped groups too
    (it counted the kept ones only: 9 of the 12 generated here); reward_errors must count the failed calls of
    the dropped groups (it reported 0 of the 2 here: a prompt whose every call fails has zero variance)."""
    run = make_run("grpo.dynamic_sampling=true", "grpo.max_dynamic_sampling_rounds=20")
    run.workers = RecordingWorkers()
    metrics = grpo_step(run, 0)
    generated = sum(len(c.token_ids) for c in run.workers.generated)
    kept = sum(int(mask.sum()) for mask in run.workers.trained[0].loss_mask)  # completion tokens trained on
    assert generated > kept and run.workers.failed > 0
    assert metrics["rollout/tokens_per_s"] * metrics["timing/generate_s"] == pytest.approx(generated, rel=1e-9)
    assert metrics["rollout/reward_errors"] == run.workers.failed


class VersionedWorkers(StubWorkers):
    """Workers whose generator samples with the weights of its last refit, marking each completion's logprobs with
    that version (-(version + 1)); training makes a new policy version. A refit while a generation runs fails, and
    a training step of `overlap_steps` waits (up to 10 s) for the next step's generation to start beside it."""

    def __init__(self, overlap_steps: int = 0):
        super().__init__()
        self.policy_version = self.generator_version = 0
        self.generating, self.overlap_steps, self.overlapped = False, overlap_steps, []
        self.generation_started = threading.Event()

    def generate(self, prompts, params):
        self.generating = True
        self.generation_started.set()
        time.sleep(0.02)
        completions = super().generate(prompts, params)
        for c in completions:
            c.logprobs = [-(self.generator_version + 1.0)] * len(c.token_ids)
        self.generating = False
        return completions

    def train(self, batch, loss_fn):
        if len(self.trained) < self.overlap_steps:
            self.overlapped.append(self.generation_started.wait(10))
        self.generation_started.clear()
        self.policy_version += 1
        return super().train(batch, loss_fn)

    def refit(self):
        assert not self.generating, "refit during a generation"
        self.generator_version = self.policy_version
        return 0

    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "version").write_text(str(self.policy_version))

    def save_hf(self, path):
        self.save_checkpoint(path)

    def load_checkpoint(self, path):
        self.policy_version = int((Path(path) / "version").read_text())


def sampled_versions(workers: VersionedWorkers) -> list[int]:
    return [int(-batch.gen_logprobs[0][-1]) - 1 for batch in workers.trained]


ASYNC = ("grpo.async_rollouts=true", "generation.colocated=false")


@pytest.mark.parametrize(("overrides", "versions"), [((), [0, 1, 2, 3]), (ASYNC, [0, 0, 1, 2])])
def test_async_rollouts_train_each_step_on_groups_of_the_weights_one_update_before(overrides, versions):
    """On-policy, step s trains on groups sampled by the weights of s updates; with grpo.async_rollouts, by those
    of s - 1 (step 0's: sampled before anything trained), generated while the step before trained, and never
    across a refit."""
    run = make_run(*overrides, "grpo.max_steps=4")
    run.workers = VersionedWorkers(overlap_steps=3 if overrides else 0)
    for step in range(4):
        grpo_step(run, step)
    assert sampled_versions(run.workers) == versions
    assert run.workers.overlapped == ([True] * 3 if overrides else [])


def test_async_rollouts_resume_trains_on_the_groups_sampled_before_the_checkpoint(tmp_path):
    """The groups sampled ahead at a checkpoint are part of it: a run resumed there trains on them (sampled by the
    weights before the checkpoint's), as the uninterrupted run did; sampling them again would use newer weights."""
    def run_in(log_dir: Path) -> Run:
        run = make_run(*ASYNC, "grpo.max_steps=4", "grpo.val_every=0", "checkpointing.save_every=2",
                       "logger.progress_bar=false")
        run.workers = VersionedWorkers()
        run.sink = MetricsSink(log_dir, tensorboard=False, resume_step=None)
        run.checkpoints = CheckpointManager(log_dir / "checkpoints", keep_top_k=5, metric="m", higher_is_better=True)
        return run

    full = run_in(tmp_path / "full")
    loop.train(full)
    assert (tmp_path / "full/checkpoints/step_2/sampled_ahead.pkl").is_file()
    assert not (tmp_path / "full/checkpoints/step_4/sampled_ahead.pkl").exists()  # nothing sampled past the end

    resumed = run_in(tmp_path / "resumed")
    path = tmp_path / "full/checkpoints/step_2"
    start = resume(resumed, ResumePoint(path, full.checkpoints.load_state(path)))
    loop.train(resumed, start_step=start)
    assert start == 2 and sampled_versions(resumed.workers) == [1, 2]
    for got, want in zip(resumed.workers.trained, full.workers.trained[2:]):
        assert [t.tolist() for t in got.input_ids] == [t.tolist() for t in want.input_ids]
        assert [t.tolist() for t in got.gen_logprobs] == [t.tolist() for t in want.gen_logprobs]
        assert [t.tolist() for t in got.advantages] == [t.tolist() for t in want.advantages]


def test_async_rollouts_resumed_past_the_end_of_its_run_says_its_first_step_is_on_policy(tmp_path, caplog):
    """A run's last checkpoint holds no groups sampled ahead (nothing is sampled past grpo.max_steps): resumed with
    a larger max_steps, its first step samples its own groups with the checkpoint's weights (on-policy, unlike
    the run that had not stopped there). That is said, not silently inexact; the steps after it are one update old."""
    def run_in(log_dir: Path, max_steps: int) -> Run:
        run = make_run(*ASYNC, f"grpo.max_steps={max_steps}", "grpo.val_every=0", "checkpointing.save_every=2",
                       "logger.progress_bar=false")
        run.workers = VersionedWorkers()
        run.sink = MetricsSink(log_dir, tensorboard=False, resume_step=None)
        run.checkpoints = CheckpointManager(log_dir / "checkpoints", keep_top_k=5, metric="m", higher_is_better=True)
        return run

    short = run_in(tmp_path / "short", 2)
    loop.train(short)
    path = tmp_path / "short/checkpoints/step_2"
    longer = run_in(tmp_path / "longer", 4)
    with caplog.at_level("WARNING", logger="grpo_app.loop"):
        start = resume(longer, ResumePoint(path, short.checkpoints.load_state(path)))
    assert start == 2 and "holds no groups sampled ahead" in caplog.text and "step 2 samples its own" in caplog.text
    loop.train(longer, start_step=start)
    assert sampled_versions(longer.workers) == [2, 2]  # step 2 on-policy; step 3 one update old again

    caplog.clear()  # a checkpoint with its groups sampled ahead, or one at the end of the run: nothing to say
    with caplog.at_level("WARNING", logger="grpo_app.loop"):
        resume(run_in(tmp_path / "again", 2), ResumePoint(path, short.checkpoints.load_state(path)))
    assert "sampled ahead" not in caplog.text


def test_async_rollouts_error_in_the_sampling_thread_reaches_the_loop():
    class FailingReward(StubWorkers):
        calls = 0

        def score(self, requests):
            self.calls += 1
            if self.calls > 2:  # step 0's groups scored in two parts; then those sampled ahead, beside its training
                raise RuntimeError("reward service down")
            return super().score(requests)

    run = make_run(*ASYNC, "grpo.max_steps=3")
    run.workers = FailingReward()
    with pytest.raises(RuntimeError, match="reward service down"):
        grpo_step(run, 0)


@pytest.mark.parametrize(("overrides", "match"), [
    (("grpo.async_rollouts=true",), "set generation.colocated=false and generation.in_policy_workers=false"),
    ((*ASYNC, "generation.in_policy_workers=true"), "generation.in_policy_workers=true"),
    ((*ASYNC, "loss.importance.enabled=false"), "set loss.importance.enabled=true"),
])
def test_async_rollouts_layouts_that_cannot_overlap_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["policy.model_name=unused", *overrides])


def test_async_summary_counts_the_wait_not_the_generation_sampled_beside_the_step_before(tmp_path):
    """Step 0 samples its own groups (on its time) and waits 0.5 s for step 1's; step 1's were sampled beside step
    0's training. The table's total is the mean time the steps spent themselves, computed here by hand."""
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    sink.log(0, {"timing/generate_s": 4.0, "timing/reward_s": 1.0, "timing/logprobs_s": 0.0, "timing/train_s": 3.0,
                 "timing/rollout_wait_s": 0.5, "timing/refit_s": 1.0, "timing/step_s": 9.6,
                 "rollout/sampled_ahead": 0.0})
    sink.log(1, {"timing/generate_s": 2.0, "timing/reward_s": 1.0, "timing/logprobs_s": 0.0, "timing/train_s": 5.0,
                 "timing/refit_s": 1.0, "timing/step_s": 6.1, "rollout/sampled_ahead": 1.0})
    *table, where = sink.summary().splitlines()
    assert where == f"metrics: {tmp_path / 'metrics.jsonl'}"  # the run never said where its metrics went
    rows = [line.split() for line in table[1:]]
    own = {row[0]: row[1] for row in rows if row[1] != "*"}  # phase -> mean s/step the steps spent themselves
    beside = {row[0]: row[2] for row in rows if row[1] == "*"}
    per_step = [4.0 + 1.0 + 0.5 + 0.0 + 3.0 + 1.0, 0.0 + 5.0 + 1.0]  # step 1: its sampling ran beside step 0
    assert own["total"] == f"{sum(per_step) / 2:.3f}"
    assert (own["generate"], own["rollout_wait"], own["train"]) == ("2.000", "0.250", "4.000")
    assert beside == {"generate": "2.000", "reward": "1.000"}  # step 1's own sampling times
    assert sink.plot(tmp_path / "summary.png").stat().st_size > 0


@pytest.mark.parametrize("progress_bar", ["false", "true"])  # true: stderr is no terminal here (pytest captures it)
def test_without_a_progress_bar_each_step_and_each_validation_is_a_log_line(tmp_path, caplog, progress_bar):
    """`logger.progress_bar=false`, or a run whose stderr is a log file, showed no progress until the summary (the
    bar's redraws were one endless line in a file), and a validation's result was in metrics.jsonl only; the lines
    use the steps and keys of metrics.jsonl."""
    run = make_run("grpo.max_steps=2", "grpo.val_every=2", f"logger.progress_bar={progress_bar}")
    run.val_prompts = run.train_prompts.items[:2]
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    with caplog.at_level("INFO", logger="grpo_app.loop"):
        loop.train(run)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("step", "validation"))]
    assert [line.split(":")[0] for line in lines] == ["validation at step 0 (2 prompts)", "step 0 (1 of 2)",
                                                      "step 1 (2 of 2)", "validation at step 2 (2 prompts)"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[1] == (f"step 0 (1 of 2): rollout/reward_mean={records[0]['rollout/reward_mean']:.4g} "
                        f"val/reward_mean={records[0]['val/reward_mean']:.4g} train/loss=0 "
                        f"timing/step_s={records[0]['timing/step_s']:.4g}")
    assert lines[3] == f"validation at step 2 (2 prompts): val/reward_mean={records[2]['val/reward_mean']:.4g}"


def test_val_at_start_false_skips_the_validation_of_the_base_model(tmp_path, caplog):
    """NeMo-RL's grpo.val_at_start=false (verl's trainer.val_before_train=False): a long run need not score its base
    model first; the later validations stay, and the summary says from which step it compares."""
    run = make_run("grpo.max_steps=4", "grpo.val_every=2", "grpo.val_at_start=false", "logger.progress_bar=false")
    run.val_prompts = run.train_prompts.items[:2]
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    with caplog.at_level("INFO", logger="grpo_app.loop"):
        loop.train(run)
    validations = [r.getMessage().split(" (")[0] for r in caplog.records if r.getMessage().startswith("validation")]
    assert validations == ["validation at step 2", "validation at step 4"]
    steps, values = run.sink.series("val/reward_mean")
    assert steps == [2, 4]
    assert f"validation reward: {values[0]:.3f} at step 2 -> {values[1]:.3f}" in run.sink.summary()


def test_steps_whose_groups_all_scored_alike_are_warned_about_once_and_when_ten_come_in_a_row(caplog):
    """A constant reward trained on nothing for the whole run (exit 0, loss 0, grad norm 0) without a log line; then
    the default run's converged policy repeated the warning at 30 of its last 60 steps (seed 2)."""
    from rl_core.advantages import grpo_advantages

    groups = torch.tensor([0] * 4 + [1] * 4)
    alike, differ = torch.tensor([0.5] * 4 + [1.0] * 4), torch.tensor([0.0] + [0.5] * 3 + [1.0] * 4)
    # steps 1-3 and 5 alike (intermittent, as a converged policy's), then 7-26 alike: 10 in a row at step 16
    rewards = [differ, alike, alike, alike, differ, alike, differ] + [alike] * 20
    log = loop.NoAdvantageLog()
    with caplog.at_level(logging.INFO, logger="grpo_app.loop"):
        for step, step_rewards in enumerate(rewards):
            log.update(step, step_rewards, grpo_advantages(step_rewards, groups), kl_coef=0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(r.levelname == "WARNING" for r in caplog.records), lines
    assert lines[0].startswith("step 1: every group's completions got the same reward (reward_mean 0.75): all "
                               "advantages are 0, so this step trains on nothing (loss.kl_coef=0);")
    assert lines[1] == ("steps 7-16: 10 in a row without advantage (reward_mean 0.75 now), trained on nothing "
                        "(loss.kl_coef=0): the run may have stalled")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_app.loop"):
        loop.NoAdvantageLog().update(3, alike, grpo_advantages(alike, groups), kl_coef=0.01)
    assert "so this step trains on nothing but the KL term;" in caplog.text  # not "(loss.kl_coef=0)"


def test_the_summary_counts_the_steps_without_advantage(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    for step in range(8):  # no advantage at steps 2 and 5-7: the run ended on a plateau that began at step 5
        sink.log(step, {"rollout/advantages_abs_mean": 0.0 if step in (2, 5, 6, 7) else 0.3, "timing/step_s": 1.0})
    assert sink.steps_without_advantage() == [2, 5, 6, 7]
    line = ("steps without advantage (every group's completions scored alike, so they trained on the KL term alone, "
            "if any): 4 of 8")
    assert f"{line}, each one from step 5 on" in sink.summary().splitlines()
    sink.log(8, {"rollout/advantages_abs_mean": 0.1, "timing/step_s": 1.0})  # the plateau ended before the run
    assert line.replace("4 of 8", "4 of 9") in sink.summary().splitlines()


class SlowValidationAndCheckpointWorkers(VersionedWorkers):
    """A validation's generation (greedy) takes VAL_S, a checkpoint's save CKPT_S; a training step almost nothing."""

    VAL_S, CKPT_S = 0.6, 0.2

    def generate(self, prompts, params):
        if params.temperature == 0.0:
            time.sleep(self.VAL_S)
        return super().generate(prompts, params)

    def save_checkpoint(self, path):
        time.sleep(self.CKPT_S)
        super().save_checkpoint(path)


def test_validation_and_checkpoint_times_are_logged_and_counted_in_the_summary(tmp_path):
    """timing/step_s and the summary left validation and checkpoint saving out: the table said where the step's time
    went, not the run's. Now each validation's seconds are `timing/val_s` in the record of its val/* metrics (the one
    of step 2 ran beside step 1's checkpoint, which it scores), each checkpoint's `timing/checkpoint_s` in the record
    of the step it saves, without that validation; the table's means are over the 4 steps, computed here by hand."""
    run = make_run("grpo.max_steps=4", "grpo.val_every=2", "checkpointing.save_every=2", "checkpointing.save_hf=never",
                   "logger.progress_bar=false")
    run.val_prompts = run.train_prompts.items[:2]
    run.workers = SlowValidationAndCheckpointWorkers()
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    run.checkpoints = CheckpointManager(tmp_path / "checkpoints", keep_top_k=5, metric="val/reward_mean",
                                        higher_is_better=True)
    loop.trainer_state(run, 0, None)  # imports the engine (as preflight has in a run), else in the first checkpoint
    loop.train(run)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # 4: the last validation's record
    assert [("timing/val_s" in r, "timing/checkpoint_s" in r) for r in records] == [
        (True, False), (False, True), (True, False), (False, True), (True, False)]
    val_s, ckpt_s = SlowValidationAndCheckpointWorkers.VAL_S, SlowValidationAndCheckpointWorkers.CKPT_S
    assert all(r["timing/val_s"] >= val_s for r in records if "timing/val_s" in r)
    assert all(ckpt_s <= r["timing/checkpoint_s"] < ckpt_s + val_s for r in records if "timing/checkpoint_s" in r)
    assert all(r["timing/step_s"] < ckpt_s for r in records[:4])  # neither is in the step's time

    *table, where = run.sink.summary().splitlines()
    assert where == f"metrics: {tmp_path / 'metrics.jsonl'}"
    *rows, note = [line.split() for line in table[2:]]  # after the validation reward line and the header
    assert " ".join(note) == "val, checkpoint: not in timing/step_s; the run's 3 validations and 2 checkpoints spread " \
                             "over its 4 steps"
    means = {row[0]: float(row[1]) for row in rows}
    want = {phase: sum(r.get(f"timing/{phase}_s", 0.0) for r in records) / 4
            for phase in ("generate", "reward", "logprobs", "train", "refit", "val", "checkpoint")}
    assert list(means) == [*want, "total"]
    assert {k: means[k] for k in want} == pytest.approx(want, abs=1e-3)
    assert means["total"] == pytest.approx(sum(want.values()), abs=1e-3)
    shares = {row[0]: float(row[2].rstrip("%")) for row in rows if row[0] != "total"}
    assert shares == pytest.approx({k: 100 * v / sum(want.values()) for k, v in want.items()}, abs=0.06)
    assert run.sink.plot(tmp_path / "summary.png").stat().st_size > 0


def test_a_checkpoint_appears_only_once_the_record_of_the_step_it_saves_is_logged(tmp_path, monkeypatch):
    """A run resumed from step_N keeps the records of the steps before N, so the record of step N - 1 (the one
    step_N saves) must be in metrics.jsonl before step_N appears under its name: it was logged just after, and a
    kill in between lost it for good (the async kill-and-resume e2e test, under load, resumed without step 3's)."""
    from rl_core import checkpoint_io

    logged_at_publish = {}
    publish = checkpoint_io.publish_dir

    def recording_publish(tmp, final, **kwargs):
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        logged_at_publish[Path(final).name] = [json.loads(line)["step"] for line in lines]
        return publish(tmp, final, **kwargs)

    monkeypatch.setattr(checkpoint_io, "publish_dir", recording_publish)
    run = make_run("grpo.max_steps=4", "grpo.val_every=0", "checkpointing.save_every=2", "checkpointing.save_hf=never",
                   "logger.progress_bar=false")
    run.workers = SlowValidationAndCheckpointWorkers()
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    run.checkpoints = CheckpointManager(tmp_path / "checkpoints", keep_top_k=5, metric="m", higher_is_better=True)
    loop.trainer_state(run, 0, None)  # imports the engine (as preflight has in a run), else in the first checkpoint
    loop.train(run)
    assert logged_at_publish == {"step_2": [0, 1], "step_4": [0, 1, 2, 3]}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ckpt_s = SlowValidationAndCheckpointWorkers.CKPT_S
    assert [r["timing/checkpoint_s"] >= ckpt_s for r in records if "timing/checkpoint_s" in r] == [True, True]
    assert [r["step"] for r in records if "timing/checkpoint_s" in r] == [1, 3]


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_save_request_saves_after_the_step_in_progress_and_stops(tmp_path, caplog, checkpointing: bool):
    """SIGUSR1 (main's handler) asks for a save during step 1: the run saves step_2 (no multiple of save_every) and
    stops. Without checkpointing there is nothing to save: it says so once and runs to the end."""
    requested = iter([False, True, True, True])  # asked once per step, from the end of step 1 on True
    run = make_run("grpo.max_steps=4", "grpo.val_every=0", "checkpointing.save_every=3", "checkpointing.save_hf=never",
                   f"checkpointing.enabled={str(checkpointing).lower()}", "logger.progress_bar=false")
    run.workers = SlowValidationAndCheckpointWorkers()
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    if checkpointing:
        run.checkpoints = CheckpointManager(tmp_path / "checkpoints", keep_top_k=5, metric="m", higher_is_better=True)
        loop.trainer_state(run, 0, None)  # imports the engine (as preflight has in a run), else in the first checkpoint
    with caplog.at_level("WARNING", logger="grpo_app.loop"):
        loop.train(run, save_requested=lambda: next(requested))
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if checkpointing:
        assert run.checkpoints.steps() == [2] and steps == [0, 1]
        assert (f"SIGUSR1: stopping after step 2 of 4, saved in {tmp_path}/checkpoints/step_2; the same command "
                "resumes from there") in caplog.text
    else:
        assert steps == [0, 1, 2, 3]
        assert caplog.text.count("SIGUSR1: checkpointing.enabled=false, nothing to save; the run goes on") == 1


@pytest.mark.parametrize("left_s", [-1, 86400])
def test_must_save_by_saves_a_checkpoint_and_stops_once_another_step_could_end_past_it(tmp_path, monkeypatch, caplog,
                                                                                      left_s):
    """NeMo-RL's checkpoint_must_save_by: a cluster job killed at its time limit lost every step since its last
    checkpoint. With the time spent, the run saves step_1 (no multiple of save_every) and stops; with a day left, it
    runs to the end and saves as usual."""
    import grpo_app

    monkeypatch.setattr(grpo_app, "STARTED", time.monotonic() - 3600 + left_s)  # must_save_by 1 h: left_s from now
    run = make_run("grpo.max_steps=4", "grpo.val_every=0", "checkpointing.save_every=3", "checkpointing.save_hf=never",
                   "checkpointing.must_save_by=01:00:00", "logger.progress_bar=false")
    run.workers = SlowValidationAndCheckpointWorkers()
    run.sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    run.checkpoints = CheckpointManager(tmp_path / "checkpoints", keep_top_k=5, metric="m", higher_is_better=True)
    loop.trainer_state(run, 0, None)  # imports the engine (as preflight has in a run), else in the first checkpoint
    with caplog.at_level("WARNING", logger="grpo_app.loop"):
        loop.train(run)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if left_s < 0:
        assert run.checkpoints.steps() == [1] and [r["step"] for r in records] == [0]
        assert (f"checkpointing.must_save_by=01:00:00: stopping after step 1 of 4, saved in {tmp_path}/checkpoints/"
                "step_1 (another step might end past it") in caplog.text
    else:
        assert run.checkpoints.steps() == [3, 4] and [r["step"] for r in records] == [0, 1, 2, 3]
        assert "must_save_by" not in caplog.text
