"""Packed-sequence attention without flash-attn: one causal sdpa call per packed sequence.

A packed row of T tokens holding sequences of lengths L_i needs sum L_i^2 attention scores; a dense
sdpa over the row with a block-diagonal mask computes all T^2 of them (21x more for 64 sequences of
~130 tokens in 2800-token rows, measured in bench/mfu.py). Registered with transformers'
`AttentionInterface` as "sdpa_segments": given `cu_seq_lens_q` (the flash-attn varlen keyword that HF
models pass through to the attention function), it splits q/k/v at the boundaries and runs a causal
sdpa per segment (banded where a segment is longer than the model's sliding window); without it
(padded rows with a 4-D mask), it is HF's sdpa unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SEGMENT_SDPA = "sdpa_segments"


def segment_sdpa_forward(
    module: nn.Module,
    query: Tensor,  # (1, H, T, D)
    key: Tensor,  # (1, H_kv, T, D)
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """(1, T, H, D) attention output; causal within each [cu[i], cu[i+1]) segment, nothing across."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or int(cu[-1]) != query.shape[2]:
        raise ValueError(
            f"sdpa_segments needs one packed row whose segments cover it: query {tuple(query.shape)}, "
            f"cu_seq_lens_q ends at {int(cu[-1])}"
        )
    lengths = torch.diff(cu).tolist()
    window = kwargs.get("sliding_window")
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    outs = []
    # split (not slicing in a loop): its backward is one cat, not a zero-filled copy per segment
    for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2)):
        n = q.shape[2]
        if window is None or n <= window:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # HF's sliding window: a query sees itself and the window - 1 keys before it
            offsets = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
            band = (offsets >= 0) & (offsets < window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=p, scale=scaling, enable_gqa=gqa)
        outs.append(out)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENT_SDPA, sdpa_mask)
