"""Reward functions that fail every call stop the run with one line (issue 17): raises, NaN, a string,
None, or a hang. The app's scoring path (`loop.rollout`: `Workers.submit_score` for each generator's share, the
bound checked on the whole batch) in the default run; whole `python apps/grpo` runs in the slow lane."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_app.cluster import Workers
from grpo_app.config import load_config
from grpo_app.loop import PhaseTimer, rollout
from rl_core.interfaces import Completion, RewardRequest, SamplingParams
from rollout.datasets import PromptExample
from rollout.environments import RewardFailureError, check_reward_failures, create_environment

ROOT = Path(__file__).resolve().parents[3]
BROKEN = textwrap.dedent('''
    import itertools, time

    _calls = itertools.count()

    def broken(*, prompt, completion, metadata):
        kind = next(_calls) % 4
        if kind == 0:
            raise RuntimeError("reward backend unreachable")
        return [float("nan"), "high", None][kind - 1]

    def half(*, prompt, completion, metadata):
        return None if next(_calls) % 2 else 1.0

    def hang(*, prompt, completion, metadata):
        time.sleep(600)

    def fails_on_bad(*, prompt, completion, metadata):
        return None if completion == "bad" else 1.0
''')


@pytest.fixture()
def broken_module(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _score(workers: Workers, requests: list[RewardRequest]) -> list:
    """What loop.rollout does with one batch scored in one share."""
    results = workers.submit_score(requests)()
    check_reward_failures(results, workers.cfg.env.max_failed_reward_fraction, "env.max_failed_reward_fraction")
    return results


def _workers(overrides: list[str], fn: str) -> Workers:
    """The app's Workers with rewards scored in the driver (env.num_workers=0), no Ray needed."""
    workers = Workers.__new__(Workers)
    workers.cfg = load_config(None, overrides)
    workers.rewarders = []
    workers._scoring = ThreadPoolExecutor(max_workers=1)
    workers.local_env = create_environment("function", fn=fn, num_workers=1, timeout_s=1.0)
    return workers


@pytest.mark.parametrize("fn, cause", [("broken_rewards:broken", "RuntimeError: reward backend unreachable"),
                                       ("broken_rewards:hang", "exceeded 1.0 s")])
def test_a_batch_of_failed_rewards_stops_the_run(broken_module, fn, cause):
    workers = _workers(["env.num_workers=0"], fn)
    requests = [RewardRequest(prompt="qk:2", completion="2222", metadata={})] * 8
    try:
        start = time.monotonic()
        with pytest.raises(RewardFailureError, match=rf"8 of 8 reward calls failed .*{cause}"):
            _score(workers, requests)
        assert time.monotonic() - start < 5
    finally:
        workers.local_env.close()


def test_a_tolerated_share_of_failures_goes_on(broken_module):
    """Half the calls return None: the default (stop only when all fail) goes on, 0.5 stops."""
    requests = [RewardRequest(prompt="qk:2", completion="2222", metadata={})] * 8
    for fraction, stops in ((1.0, False), (0.5, True)):
        workers = _workers(["env.num_workers=0", f"env.max_failed_reward_fraction={fraction}"], "broken_rewards:half")
        try:
            if stops:
                with pytest.raises(RewardFailureError, match=r"4 of 8 .*env.max_failed_reward_fraction=0.5"):
                    _score(workers, requests)
            else:
                assert [r.reward for r in _score(workers, requests)] == [1.0, 0.0] * 4
        finally:
            workers.local_env.close()


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["broken_rewards:broken", "broken_rewards:hang"])
def test_whole_run_exits_1_with_one_line(broken_module, tmp_path, fn):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "qk:{d}"}}\n' for d in range(8)))
    env = {**os.environ, "PYTHONPATH": f"{broken_module}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(ROOT / "apps/grpo"), "grpo.num_prompts_per_step=4",
               "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "grpo.val_every=0",
               "grpo.max_steps=2", "logger.tensorboard=false", "logger.progress_bar=false", "logger.plot=false",
               "checkpointing.enabled=false", f"logger.log_dir={tmp_path / 'run'}", "env.name=function",
               f"env.kwargs.fn={fn}", "env.kwargs.timeout_s=1", f"env.train_data={prompts}",
               f"env.val_data={prompts}", "env.num_workers=0", "generation.in_policy_workers=true"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "16 of 16 reward calls failed (>= env.max_failed_reward_fraction=1.0)" in proc.stderr


class _Tokens:
    """Token 1 decodes to "bad", any other to "good"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "bad" if ids[0] == 1 else "good"


def test_the_failure_bound_is_of_the_batch_not_of_one_generators_share(broken_module):
    """Two generators' shares, 3 of 4 and 0 of 4 calls failed: 3 of 8 in the batch is under 0.5 and the run goes on
    (each share was checked on its own: 3 of 4 stopped it)."""
    workers = _workers(["env.num_workers=0", "env.max_failed_reward_fraction=0.5"], "broken_rewards:fails_on_bad")
    def completion(prompt: int, token: int) -> Completion:
        return Completion(prompt_index=prompt, token_ids=[token], logprobs=[0.0], finish_reason="stop")

    shares = [[completion(0, 1 if i < 3 else 2) for i in range(4)], [completion(1, 2) for _ in range(4)]]
    workers.generate_parts = lambda prompts, params: iter(shares)
    run = SimpleNamespace(workers=workers, tokenizer=_Tokens(), cfg=workers.cfg)
    prompts = [PromptExample(prompt=f"p{i}", prompt_token_ids=[3]) for i in range(2)]
    try:
        _, rewards, results = rollout(run, prompts, SamplingParams(n=4), PhaseTimer())
        assert rewards.tolist() == [0.0] * 3 + [1.0] * 5 and sum(r.error is not None for r in results) == 3
        with pytest.raises(RewardFailureError, match=r"5 of 8 reward calls failed"):  # over the bound: stops
            shares[1][:2] = [completion(1, 1)] * 2
            rollout(run, prompts, SamplingParams(n=4), PhaseTimer())
    finally:
        workers.local_env.close()
