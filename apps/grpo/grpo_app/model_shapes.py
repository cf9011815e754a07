"""Real model shapes built locally: `policy.model_name: shape:<name>` (e.g. `shape:qwen2.5-0.5b`).

A checkpoint with a published model's layer sizes, the char tokenizer's vocabulary (128) and Hugging
Face's own initialisation (normal, std = initializer_range 0.02), for GPU recipes and benchmarks that
need a real workload but must not download anything. It learns the built-in tasks from scratch; for real
weights, point policy.model_name at a local Hugging Face directory instead.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
SHAPE_PREFIX = "shape:"
VOCAB_SIZE = 128  # rl_core.testing.tiny_models' char tokenizer

# Layer sizes from the published config.json of each model (vocabulary replaced by the char tokenizer's).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02),
}


def shape_config(name: str) -> Any:
    """The HF config of shape `name` (a Qwen2 config for the qwen2.5 shapes)."""
    from rl_core.testing.tiny_models import tiny_config

    if name not in SHAPES:
        raise ValueError(f"policy.model_name='{SHAPE_PREFIX}{name}': known shapes are {list(SHAPES)}")
    return tiny_config("qwen2", vocab_size=VOCAB_SIZE, **SHAPES[name])


def cached_shape_checkpoint(name: str, *, seed: int = 0) -> Path:
    """Build (once, under `cache_path("shape-models")`) and return the checkpoint of shape `name`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rl_core.checkpoint_io import atomic_dir
    from rl_core.testing.tiny_models import build_tokenizer, cache_path

    config = shape_config(name)
    path = cache_path("shape-models") / f"{name}-s{seed}"
    if (path / "config.json").exists():
        return path
    logger.info("building the %s-shaped checkpoint (HF init, std %.2f) at %s", name, config.initializer_range, path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # HF's _init_weights: std 0.02
    with atomic_dir(path) as tmp:  # readable by other users, as the tiny checkpoints
        model.save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
    return path
