"""HF attention function "sdpa_segments": packed rows through `seqpack.packed_causal_attention`.

Registered with transformers' `AttentionInterface`: given `cu_seq_lens_q` (the flash-attn varlen keyword
that HF models pass through to the attention function), the packed row goes to seqpack's packed causal
attention (a varlen kernel on CUDA in half precision, one causal sdpa per sequence elsewhere, banded
where a sequence is longer than the model's sliding window); without it (padded rows with a 4-D mask),
it is HF's sdpa unchanged.

No mask function is registered for it, on purpose: HF then builds no mask itself. Packed rows need none
(the boundaries travel as `cu_seq_lens_q`), and padded rows arrive with their 4-D mask built by
forward.py. With one registered, HF detected the packing from the position ids in every forward: a read
of a device tensor (a host sync on CUDA) and a (1, 1, T, T) mask nothing used (67 MB at 8192 tokens).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from seqpack.attention import packed_causal_attention

SEGMENT_SDPA = "sdpa_segments"
# Under policy.dtensor_cfg.compile the packed attention runs eagerly between two compiled graphs of the
# layer: its kernel choice, host-side lengths and varlen kernel are the same compiled or not, on any device.
_packed_attention = torch.compiler.disable(packed_causal_attention)


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
    if query.shape[0] != 1:
        raise ValueError(f"sdpa_segments needs one packed row: query {tuple(query.shape)} (1, H, T, D)")
    # squeeze, not [0]: a select's backward allocates zeros and copies each of q, k, v's gradients
    q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    out = _packed_attention(q, k, v, cu, max_len=kwargs.get("max_length_q"), scale=scaling,
                            window=kwargs.get("sliding_window"), dropout=dropout if module.training else 0.0)
    return out[None], None  # (1, T, H, D)


AttentionInterface.register(SEGMENT_SDPA, segment_sdpa_forward)
