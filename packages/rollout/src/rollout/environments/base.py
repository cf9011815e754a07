"""Reward environments: `FunctionEnvironment` (any `pkg.module:function` in a worker pool) and the
registry (`register_environment`, `create_environment`).

A reward function is called as `fn(prompt=str, completion=str, metadata=dict, **fn_kwargs)`, plus
`finish_reason=` ("stop" or "length", None where unknown) where its signature names that parameter, and returns
a float, a bool, a dict with "reward" (and optionally "correct"), or an object with `.reward`. A call
that raises, returns anything else (None, NaN, a string), times out or kills its worker scores 0 with
`error` set; the counts are in `last_metrics` (`reward/errors` for raised / bad values / crashes,
`reward/timeouts`), and `check_reward_failures` turns too many of them into `RewardFailureError`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl_core.interfaces import Environment, RewardRequest, RewardResult
from rl_core.registry import Registry
from rollout.environments.pool import RewardPool

logger = logging.getLogger(__name__)

# An installed package's environments, by name: found in every process (the trainer's reward workers too), where an
# in-process `@register_environment` is seen only by the process that imported its module.
ENTRY_POINT_GROUP = "rl_core.environments"
ENVIRONMENTS = Registry("environment", ENTRY_POINT_GROUP, {},
                        unknown_hint="or 'function' with env.kwargs.fn='pkg.module:function'")
_PROMPT_FIELDS: dict[str, dict[str, str]] = {}


def register_environment(name: str, *, prompt_fields: Mapping[str, str] | None = None
                         ) -> Callable[[Callable[..., Environment]], Callable[..., Environment]]:
    """Class / factory decorator: make `create_environment(name, **kwargs)` build it. `prompt_fields`: the
    metadata fields its reward reads from every prompt (field -> what it holds), which a trainer checks in a
    prompt file before it starts anything (without them every reward call would fail)."""

    def decorate(factory: Callable[..., Environment]) -> Callable[..., Environment]:
        ENVIRONMENTS.register(name)(factory)  # a name taken by another factory is an error
        _PROMPT_FIELDS[name] = dict(prompt_fields or {})
        return factory

    return decorate


def prompt_fields(name: str) -> dict[str, str]:
    """The metadata fields environment `name` reads from every prompt (field -> what it holds): those its
    `@register_environment` names (an installed entry point's module is imported for them); none when unknown."""
    if name in ENVIRONMENTS.names():
        environment_factory(name)
    return dict(_PROMPT_FIELDS.get(name, {}))


def environment_names() -> list[str]:
    return ENVIRONMENTS.names()


class RewardFailureError(RuntimeError):
    """Too many reward calls of one batch failed: training on their zeros would learn nothing."""


def check_reward_failures(results: Sequence[RewardResult], max_failed_fraction: float, key: str) -> None:
    """Raise RewardFailureError when failed calls reach `max_failed_fraction` of `results` (config `key`)."""
    failed = [r for r in results if r.error is not None]
    if not failed:
        return
    first = failed[0].error.splitlines()[0][:300]
    if len(failed) >= max_failed_fraction * len(results):
        raise RewardFailureError(
            f"{len(failed)} of {len(results)} reward calls failed (>= {key}={max_failed_fraction}); first: "
            f"{first}. Fix the reward function (or the prompt fields it reads), or raise {key} to train on")
    # below the bound the run goes on, training on their zeros: said where the run's log is read, not only in the
    # reward worker's
    logger.warning("%d of %d reward calls failed and score 0 (the run stops at %s=%s); first: %s", len(failed),
                   len(results), key, max_failed_fraction, first)


def finite_rewards(results: Sequence[RewardResult]) -> list[RewardResult]:
    """`results` with every NaN or infinite reward scored 0 as a failed call, as FunctionEnvironment scores a
    reward function's: any environment's NaN would make its group's advantages, and so the step's loss, NaN."""
    return [r if math.isfinite(r.reward) else RewardResult(reward=0.0, error=f"non-finite reward {r.reward!r}")
            for r in results]


def environment_factory(name: str) -> Callable[..., Environment]:
    """The class or factory registered as `name`, or installed under it as an `rl_core.environments` entry point
    (its signature is what `env.kwargs` must fit)."""
    return ENVIRONMENTS.get(name, config_key="env.name")


def create_environment(name: str, **kwargs: Any) -> Environment:
    """Build environment `name` (config key `env.name`); an unknown name lists the registered ones."""
    return environment_factory(name)(**kwargs)


@register_environment("function")
class FunctionEnvironment:
    """Scores completions with the reward function at import path `fn` in `num_workers` subprocesses."""

    def __init__(self, fn: str, *, num_workers: int = 2, timeout_s: float = 10.0,
                 fn_kwargs: dict[str, Any] | None = None, memory_limit_mb: int | None = 4096) -> None:
        self.pool = RewardPool(fn, num_workers=num_workers, timeout_s=timeout_s, fn_kwargs=fn_kwargs,
                               memory_limit_mb=memory_limit_mb)
        self.last_metrics: dict[str, float] = {}

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order; failures score 0 and are counted in `last_metrics`."""
        outcomes = self.pool.run([(r.prompt, r.completion, dict(r.metadata), {"finish_reason": r.finish_reason})
                                  for r in requests])
        results = []
        for outcome in outcomes:
            if outcome.status == "ok":
                results.append(RewardResult(reward=outcome.reward, correct=outcome.correct))
            else:
                results.append(RewardResult(reward=0.0, correct=None, error=f"{outcome.status}: {outcome.message}"))
        errors = sum(o.status in ("error", "crash") for o in outcomes)
        timeouts = sum(o.status == "timeout" for o in outcomes)
        if errors or timeouts:
            first = next(o for o in outcomes if o.status != "ok")
            logger.warning("%d reward errors, %d timeouts in %d calls (first: %s)", errors, timeouts,
                           len(outcomes), (first.message or "")[:300])
        num = max(len(results), 1)
        graded = [r.correct for r in results if r.correct is not None]
        self.last_metrics = {
            "reward/calls": float(len(results)),
            "reward/errors": float(errors),
            "reward/timeouts": float(timeouts),
            "reward/mean": sum(r.reward for r in results) / num,
        }
        if graded:
            self.last_metrics["reward/accuracy"] = sum(graded) / len(graded)
        return results

    def close(self) -> None:
        self.pool.close()
