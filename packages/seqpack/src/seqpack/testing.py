"""Test helpers for packed rows: an explicit float64 reference that the engines' and rollout's packed
attention paths are checked against."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reference_packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: list[int],
                               window: int | None = None) -> Tensor:
    """(T, H, D) attention from explicit scores, a dense block-diagonal causal mask and softmax (run it in
    float64); GQA by repeating K/V heads; `window` as HF's sliding window (query i sees keys i-window+1..i)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    t = q.shape[0]
    seg = torch.zeros(t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        seg[s:e] = i
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(t, t, dtype=torch.bool).triu(-(window - 1))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
