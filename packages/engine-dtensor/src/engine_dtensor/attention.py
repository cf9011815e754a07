"""Packed-sequence attention when HF's flash_attention_2 is not used: a varlen kernel on CUDA, else one
causal sdpa call per packed sequence.

On CUDA in bf16/fp16 the whole packed row goes to one varlen kernel that takes `cu_seq_lens_q` once per
micro-batch: flash-attn's `flash_attn_varlen_func` when flash-attn imports, else torch's own
`torch.nn.attention.varlen.varlen_attn` (flash kernels inside torch). One sdpa per sequence on CUDA
lets cuDNN build a plan for every new length: 16 s for the first `train_batch` on new lengths against
1.2 s warm on an H100 (issue 13); the varlen kernels have no per-shape planning. Elsewhere (CPU,
float32) it is the per-sequence sdpa below.

A packed row of T tokens holding sequences of lengths L_i needs sum L_i^2 attention scores; a dense
sdpa over the row with a block-diagonal mask computes all T^2 of them (21x more for 64 sequences of
~130 tokens in 2800-token rows, measured in bench/mfu.py). Registered with transformers'
`AttentionInterface` as "sdpa_segments": given `cu_seq_lens_q` (the flash-attn varlen keyword that HF
models pass through to the attention function), it splits q/k/v at the boundaries and runs a causal
sdpa per segment (banded where a segment is longer than the model's sliding window); without it
(padded rows with a 4-D mask), it is HF's sdpa unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

SEGMENT_SDPA = "sdpa_segments"
logger = logging.getLogger(__name__)
VarlenKernel = Literal["flash_attn", "torch", "none"]


@functools.cache
def varlen_kernel(device_type: str) -> VarlenKernel:
    """The varlen kernel for packed rows on this device, chosen once and logged: flash-attn's when it
    imports, else torch's, on CUDA; 'none' (one sdpa per sequence) elsewhere."""
    kernel: VarlenKernel = "none"
    if device_type == "cuda":
        try:
            import flash_attn  # noqa: F401

            kernel = "flash_attn"
        except Exception:  # noqa: BLE001 - missing, or built for another torch/CUDA
            if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
                kernel = "torch"
    logger.info("packed attention on %s: %s", device_type,
                {"flash_attn": "flash_attn_varlen_func", "torch": "torch.nn.attention.varlen.varlen_attn",
                 "none": "one causal sdpa per sequence"}[kernel])
    return kernel


def _uses_varlen(query: Tensor, dropout: float) -> bool:
    """Varlen kernels are flash kernels: CUDA, half precision, no dropout (RL runs without it)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and varlen_kernel("cuda") != "none")


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int, *,
                            scale: float | None, window: int | None, kernel: VarlenKernel) -> Tensor:
    """Causal attention within each [cu[i], cu[i+1]) of (T, H, D) q and (T, H_kv, D) k/v -> (T, H, D).

    `window`: HF's sliding window, a query sees itself and the window - 1 keys before it.
    """
    left = -1 if window is None else window - 1
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len,
                                      softmax_scale=scale, causal=True, window_size=(left, 0))
    from torch.nn.attention.varlen import varlen_attn

    groups = query.shape[1] // key.shape[1]
    gqa: dict[str, Any] = {}
    if groups > 1 and "enable_gqa" in inspect.signature(varlen_attn).parameters:  # torch >= 2.12
        gqa["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                       window_size=(left, 0), **gqa)


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
    window = kwargs.get("sliding_window")
    p = dropout if module.training else 0.0
    if _uses_varlen(query, p):
        max_len = kwargs.get("max_length_q") or int(torch.diff(cu).max())
        out = varlen_causal_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                                      cu, max_len, scale=scaling, window=window, kernel=varlen_kernel("cuda"))
        return out[None], None  # (1, T, H, D)
    lengths = torch.diff(cu).tolist()
    gqa = query.shape[1] != key.shape[1]
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
