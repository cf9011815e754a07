"""ckpt-convert: Hugging Face <-> megatron-core checkpoints.

Modules (imported on demand; none imports megatron at package import time):
- `mcore_model`: HF config -> `MCoreModelConfig` / megatron `TransformerConfig`.
- `mapping`: HF <-> mcore tensor names and layouts, one tensor at a time.
"""

from ckpt_convert import megatron_noise

megatron_noise.silence()  # before any megatron import: its import-time warnings are not the user's to act on
