"""ckpt-convert."""
