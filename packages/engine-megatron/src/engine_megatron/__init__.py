"""engine-megatron."""

from ckpt_convert import megatron_noise

megatron_noise.silence()  # before any megatron import: its import-time warnings are not the user's to act on
