"""Reward functions: plain `fn(prompt=, completion=, metadata=, **kwargs)` callables that run inside reward
worker subprocesses (rollout.environments.pool). Modules here import neither torch nor rl_core, so a
worker starts fast."""
