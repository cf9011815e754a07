"""The loop's data plumbing with stand-in workers: batch layout, DAPO dynamic sampling refills, and when
the separate prev-logprob pass runs."""

from __future__ import annotations

import math

import pytest
import torch

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
from grpo_app.prompts import PromptSource
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


def test_prev_logprob_pass_runs_only_with_several_optimizer_steps_per_batch():
    on_policy = make_run()  # 6 samples, train_global_batch_size 6: one optimizer step
    grpo_step(on_policy, 0)
    assert on_policy.workers.logprob_calls == [] and on_policy.workers.trained[0].prev_logprobs is None
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
