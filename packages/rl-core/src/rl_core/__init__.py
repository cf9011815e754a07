"""rl-core."""
