"""The loop's data plumbing with stand-in workers: batch layout and DAPO dynamic sampling refills."""

from __future__ import annotations

import torch

from grpo_app.config import load_config
from grpo_app.loop import PhaseTimer, Run, build_batch, sample_groups
from grpo_app.prompts import PromptSource
from rl_core.interfaces import Completion, RewardResult
from rollout.datasets import PromptExample


class StubWorkers:
    """Prompt i's completions all score `rewards[i]` unless i is odd: then they differ (non-zero variance)."""

    def generate(self, prompts, params):
        return [Completion(prompt_index=i, token_ids=[p[0], 9, 2][: 1 + k % 3], logprobs=[-0.5] * (1 + k % 3),
                           finish_reason="stop") for i, p in enumerate(prompts) for k in range(params.n)]

    def score(self, requests):
        return [RewardResult(reward=float(r.metadata["odd"]) * (k % 2)) for k, r in enumerate(requests)]


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
    assert len(prompts) == 3 and len(completions) == 6 and len(rewards) == 6


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
