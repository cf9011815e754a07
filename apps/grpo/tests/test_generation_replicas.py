"""How prompts reach the generator replicas (grpo_app.cluster.generate_by_replica), with stand-in actors on a
local Ray: every rank of a tensor-parallel group gets the same prompts, the group answers once, and a
replica without prompts is not called (vLLM's TP ranks step together; an uncalled rank is no problem)."""

from __future__ import annotations

import pytest
import ray
import torch

from grpo_app.cluster import generate_by_replica, start_ray
from grpo_app.config import load_config
from rl_core.interfaces import Completion, SamplingParams


@ray.remote(num_cpus=0)
class StandInRank:
    """Answers each prompt with [rank, *prompt] and remembers what it was asked; seeded, it appends 4 draws of
    one generator per call seeded with params.seed, as the torch backend's dense path samples."""

    def __init__(self, rank: int) -> None:
        self.rank, self.fail, self.asked = rank, False, []

    def reset(self, fail: bool = False) -> None:
        self.fail, self.asked = fail, []

    def generate(self, prompts, params):
        self.asked.append([list(p) for p in prompts])
        if self.fail:
            raise RuntimeError(f"rank {self.rank} failed")
        if params.seed is not None:
            draws = torch.randint(1000, (len(prompts), 4), generator=torch.Generator().manual_seed(params.seed))
            return [Completion(prompt_index=i, token_ids=[self.rank, *p, *row], logprobs=[0.0] * (5 + len(p)),
                               finish_reason="stop") for i, (p, row) in enumerate(zip(prompts, draws.tolist()))]
        return [Completion(prompt_index=i, token_ids=[self.rank, *p], logprobs=[0.0] * (1 + len(p)),
                           finish_reason="stop") for i, p in enumerate(prompts)]

    def calls(self):
        return self.asked


@pytest.fixture(scope="module")
def actors():
    start_ray(load_config(None))
    ranks = [StandInRank.remote(r) for r in range(3)]  # shared by the tests: each actor is a process
    yield ranks
    ray.shutdown()


@pytest.fixture
def ranks(actors):
    ray.get([r.reset.remote() for r in actors])
    return actors


def test_tensor_parallel_ranks_get_the_same_prompts_and_answer_once(ranks):
    prompts = [[10 + i] for i in range(5)]
    parts = list(generate_by_replica([ranks[:2], ranks[2:]], prompts, SamplingParams()))  # TP=2, then one rank
    completions = sorted((c for part in parts for c in part), key=lambda c: c.prompt_index)
    # the first rank of each group answers; indices point into the whole prompt list
    assert [c.token_ids for c in completions] == [[0, 10], [0, 11], [0, 12], [2, 13], [2, 14]]
    asked = ray.get([r.calls.remote() for r in ranks])
    assert asked[0] == asked[1] == [prompts[:3]] and asked[2] == [prompts[3:]]


def test_a_replica_without_prompts_is_not_called(ranks):
    parts = list(generate_by_replica([[ranks[0]], [ranks[1]]], [[7]], SamplingParams()))
    assert [[c.token_ids for c in part] for part in parts] == [[[0, 7]]]
    assert ray.get(ranks[1].calls.remote()) == []


def test_a_failing_follower_rank_fails_the_call(ranks):
    ray.get(ranks[1].reset.remote(fail=True))
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1 failed"):
        list(generate_by_replica([ranks[:2]], [[5], [6]], SamplingParams()))


def test_replicas_draw_independently_and_tensor_parallel_ranks_alike(ranks):
    """The same prompt on two replicas of one seeded call: different draws (with the call's seed on every replica,
    identical ones: the torch backend keyed its noise on the local row); the first replica draws as a one-replica
    call; and the same call again draws the same (a resume is exact)."""
    params = SamplingParams(seed=5)
    split = [c.token_ids for part in generate_by_replica([ranks[:2], ranks[2:]], [[7], [7]], params) for c in part]
    again = [c.token_ids for part in generate_by_replica([ranks[:2], ranks[2:]], [[7], [7]], params) for c in part]
    alone = [c.token_ids for part in generate_by_replica([[ranks[0]]], [[7]], params) for c in part]
    first, second = sorted(split)  # rank 0's answer, then rank 2's
    assert first[2:] != second[2:] and sorted(again) == sorted(split) and alone == [first]
    # a backend that seeds each prompt (vLLM) keeps the call's seed on every replica: the same samples however many
    same = [c.token_ids for part in generate_by_replica([ranks[:2], ranks[2:]], [[7], [7]], params, reseed=False)
            for c in part]
    assert sorted(t[2:] for t in same) == [first[2:], first[2:]]


def test_only_a_backend_that_seeds_each_prompt_keeps_the_calls_seed_on_every_replica():
    from rollout.torch_backend import TorchGenerationBackend
    from rollout.vllm_backend import VLLMGenerationBackend

    assert VLLMGenerationBackend.seeds_each_prompt and not getattr(TorchGenerationBackend, "seeds_each_prompt", False)
