"""grpo_app."""
