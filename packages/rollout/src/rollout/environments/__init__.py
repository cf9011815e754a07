"""Reward environments (rl-core `Environment`): a registry by name, the built-ins (`math`, `repeat_char`,
`copy_digits`) and `function` for a user's `pkg.module:function`, all scored in a subprocess pool with a
time limit, memory limit and sandbox (rollout.environments.pool, rollout._sandbox), and `reward_model`, a
Hugging Face sequence-classification model scoring in-process (rollout.environments.reward_model)."""

from rollout.environments import builtin, reward_model
from rollout.environments.base import (
    FunctionEnvironment,
    RewardFailureError,
    check_reward_failures,
    create_environment,
    environment_factory,
    environment_names,
    finite_rewards,
    prompt_fields,
    register_environment,
)
from rollout.environments.builtin import toy_prompts

__all__ = ["FunctionEnvironment", "RewardFailureError", "builtin", "reward_model", "check_reward_failures", "create_environment", "environment_factory",
           "environment_names", "finite_rewards", "prompt_fields", "register_environment",
           "toy_prompts"]
