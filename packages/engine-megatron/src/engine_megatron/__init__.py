"""engine-megatron."""
