"""The `rollout_sdpa` attention implementation used by the torch backend for decoding.

Same math as transformers' "sdpa", but grouped-query attention goes to `scaled_dot_product_attention`
with `enable_gqa=True` even when a padding mask is present. transformers' sdpa path repeats the K/V
heads (`repeat_kv`) whenever a mask is given, which copies the whole KV cache every decode step: on CPU
that copy was a third of the decode time of a tiny GQA model. Masks come from transformers' own sdpa
mask function, registered under the same name.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "rollout_sdpa"


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (B, H, Lq, D), key/value (B, H_kv, Lk, D) -> (B, Lq, H, D)."""
    if kwargs.get("position_bias") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(f"attn_implementation={NAME!r} does not support position biases or attention sinks "
                         f"({type(module).__name__}); build the backend with attn_implementation='sdpa'")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `rollout_sdpa` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
