"""The built-in environments: `math` (math-verify) and the toy tasks of rollout.rewards.toy.

Each is a `FunctionEnvironment` over a reward function of rollout.rewards, so every built-in scores in
the same worker pool, with the same time limit and error accounting as a user's function.
"""

from __future__ import annotations

from typing import Any

from rollout.environments.base import FunctionEnvironment, register_environment
from rollout.rewards.toy import TOY_TASKS


@register_environment("math", prompt_fields={"answer": "the reference answer"})
def make_math_environment(*, num_workers: int = 2, timeout_s: float = 10.0, require_boxed: bool = False,
                          memory_limit_mb: int | None = 4096) -> FunctionEnvironment:
    """Math answers checked with math-verify (reference answer in metadata['answer'])."""
    return FunctionEnvironment("rollout.rewards.math_answer:math_reward", num_workers=num_workers,
                               timeout_s=timeout_s, fn_kwargs={"require_boxed": require_boxed},
                               memory_limit_mb=memory_limit_mb)


@register_environment("repeat_char")
def make_repeat_char_environment(*, num_workers: int = 1, timeout_s: float = 10.0, answer_len: int = 4,
                                 stop_bonus: float = 0.2, memory_limit_mb: int | None = 4096) -> FunctionEnvironment:
    """Toy task: repeat the character the prompt names `answer_len` times, then stop."""
    return FunctionEnvironment(TOY_TASKS["repeat_char"][1], num_workers=num_workers, timeout_s=timeout_s,
                               fn_kwargs={"answer_len": answer_len, "stop_bonus": stop_bonus},
                               memory_limit_mb=memory_limit_mb)


@register_environment("copy_digits")
def make_copy_digits_environment(*, num_workers: int = 1, timeout_s: float = 10.0, stop_bonus: float = 0.2,
                                 memory_limit_mb: int | None = 4096) -> FunctionEnvironment:
    """Toy task: copy the digit string at the end of the prompt, then stop."""
    return FunctionEnvironment(TOY_TASKS["copy_digits"][1], num_workers=num_workers, timeout_s=timeout_s,
                               fn_kwargs={"stop_bonus": stop_bonus}, memory_limit_mb=memory_limit_mb)


def toy_prompts(task: str, num: int, *, split: str = "train", seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
    """`num` prompts {"prompt", "metadata"} of toy task `task` from the train or held-out validation split."""
    if task not in TOY_TASKS:
        raise ValueError(f"toy task {task!r} is not known; choose one of {sorted(TOY_TASKS)}")
    return TOY_TASKS[task][0](num, split=split, seed=seed, **kwargs)
