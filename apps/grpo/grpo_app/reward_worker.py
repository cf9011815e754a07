"""The reward worker: a Ray actor hosting an `Environment` (rollout.environments).

Apart from the engines' actors (grpo_app.workers) because it needs neither torch nor transformers, whose imports
were two thirds of its start (~4 of 6 CPU-seconds, in every trainer start). An environment that needs them
(`reward_model`) imports them itself.
"""

from __future__ import annotations

from typing import Any

import ray

from grpo_app.worker_logging import setup_worker_logging


@ray.remote
class RewardWorker:
    """An `Environment`; it runs untrusted scoring in its own subprocess pool with time limits. An in-process
    scorer (`reward_model`) gets one CPU thread: Ray sets OMP_NUM_THREADS, where it is unset, to the actor's CPUs
    (none here), at least 1."""

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        from rollout.environments import create_environment

        setup_worker_logging()
        self.env = create_environment(name, **kwargs)

    def score(self, requests: list[Any]) -> list[Any]:
        return self.env.score(requests)

    def close(self) -> None:
        # a method of the actor's own, not a function of the driver's sent with __ray_call__: that unpickled
        # grpo_app.cluster here (torch, ~4 CPU-seconds), which under load outlasted the driver's wait for the close
        close_environment(self.env)


def close_environment(env: Any) -> None:
    if hasattr(env, "close"):  # stop its scoring subprocesses (Environment has no close())
        env.close()
