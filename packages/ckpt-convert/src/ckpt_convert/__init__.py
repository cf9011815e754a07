"""ckpt-convert: Hugging Face <-> megatron-core checkpoints.

Modules (imported on demand; none imports megatron at package import time):
- `megatron_cpu`: `ensure_cpu_compat()`, `cpu_device_context()` (megatron-core on CPU/gloo).
- `mcore_model`: HF config -> `MCoreModelConfig` / megatron `TransformerConfig`; `build_gpt_model()`.
- `mapping`: HF <-> mcore tensor names and layouts, one tensor at a time.
"""
