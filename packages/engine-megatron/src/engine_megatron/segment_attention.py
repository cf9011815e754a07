"""Megatron core attention for packed rows without Transformer Engine: one causal sdpa per sequence.

Megatron's local `DotProductAttention` (the CPU layer spec) takes a packed row with a dense
block-diagonal mask and computes all T^2 scores of the row; the sequences need sum L_i^2. This subclass
recovers the sequence boundaries from that mask in O(T) (a sequence starts where a token may not see
its predecessor), checks the mask is exactly block-diagonal causal over them, and then runs a causal
`scaled_dot_product_attention` per sequence. Any other input (no mask, several rows, a mask of another
shape, softmax variants) goes to megatron's implementation unchanged. With TE on GPU, packed rows use
THD varlen attention instead and this module is not in the spec.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


def block_causal_segments(mask: Tensor) -> list[int] | None:
    """Segment lengths of a (T, T) bool mask (True = masked) if it is block-diagonal causal, else None."""
    t = mask.shape[-1]
    starts = torch.cat([torch.ones(1, dtype=torch.bool), mask.diagonal(-1)])  # token i cannot see i - 1
    seg = starts.cumsum(0)
    expected = (seg[:, None] != seg[None, :]) | torch.ones(t, t, dtype=torch.bool).triu(1)
    if not torch.equal(mask, expected):
        return None
    return torch.bincount(seg - 1).tolist()


class SegmentDotProductAttention(DotProductAttention):
    """`DotProductAttention` that attends per packed sequence when given a block-diagonal causal mask."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        lengths = None
        if (attention_mask is not None and attention_mask.dtype == torch.bool and query.shape[1] == 1
                and attention_mask.shape == (1, 1, query.shape[0], key.shape[0])
                and self.softmax_offset is None and attention_bias is None and packed_seq_params is None):
            lengths = block_causal_segments(attention_mask[0, 0])
        if lengths is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, 1, heads, d] -> [1, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        gqa = q.shape[1] != k.shape[1]
        p = self.attention_dropout.p if self.training else 0.0
        outs = [  # split: its backward is one cat, not a zero-filled copy per sequence
            F.scaled_dot_product_attention(qs, ks, vs, dropout_p=p, is_causal=True, scale=self.softmax_scale,
                                           enable_gqa=gqa)
            for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))
        ]
        context = torch.cat(outs, dim=2).permute(2, 0, 1, 3).contiguous()  # [s, 1, heads, d]
        return context.view(*context.shape[:2], self.hidden_size_per_partition)
