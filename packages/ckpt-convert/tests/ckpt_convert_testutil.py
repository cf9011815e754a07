"""Helpers shared by the ckpt-convert tests (imported as a module: conftest is not importable under
pytest's importlib mode)."""

from __future__ import annotations

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
MOE_ARCHS = ("mixtral", "qwen3_moe")
# Tokens ids < 100 (the tiny vocab is 100 characters + padding to 128 in megatron).
TOKENS = torch.tensor([[1, 40, 41, 42, 17, 3, 99, 5, 60, 61, 62, 63, 2, 8, 9, 10],
                       [1, 7, 7, 7, 50, 51, 52, 0, 33, 34, 35, 36, 37, 38, 39, 2]])


def hf_logits(path) -> torch.Tensor:
    """(B, S, V) fp32 logits of the HF model at `path` for TOKENS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits
