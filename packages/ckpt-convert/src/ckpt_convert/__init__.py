"""ckpt-convert: Hugging Face <-> megatron-core checkpoints.

Modules (imported on demand; none imports megatron at package import time):
- `mcore_model`: HF config -> `MCoreModelConfig` / megatron `TransformerConfig`.
- `mapping`: HF <-> mcore tensor names and layouts, one tensor at a time.
"""
