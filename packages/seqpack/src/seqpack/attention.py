"""Causal attention over a packed row: each sequence [cu[i], cu[i+1]) attends to itself only.

One function for every packed-row consumer (both engines' training forward, rollout's batched prefill):
`packed_causal_attention` takes q (T, H, D), k / v (T, H_kv, D) and the row's `cu_seqlens`.

On CUDA in bf16/fp16 the whole row goes to one varlen kernel that takes `cu_seqlens` once per call:
flash-attn's `flash_attn_varlen_func` when flash-attn imports, else torch's own
`torch.nn.attention.varlen.varlen_attn` (flash kernels inside torch). One sdpa per sequence on CUDA lets
cuDNN build a plan for every new length: 16 s for the first `train_batch` on new lengths against 1.2 s
warm on an H100 (issue 13); the varlen kernels have no per-shape planning. Elsewhere (CPU, float32,
dropout) it is one causal sdpa per sequence: a dense sdpa over the row with a block-diagonal mask would
compute all T^2 scores where the sequences need sum L_i^2 (21x more for 64 sequences of ~130 tokens in
2800-token rows, measured in bench/mfu.py).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import weakref
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

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


def uses_varlen(query: Tensor, dropout: float = 0.0) -> bool:
    """Varlen kernels are flash kernels: CUDA, half precision, no dropout (RL runs without it)."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and varlen_kernel("cuda") != "none")


@functools.cache
def _varlen_attn_takes_gqa() -> bool:
    """torch >= 2.12's varlen_attn takes K/V with fewer heads (asked once: this runs in every layer)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int, *,
                            scale: float | None, window: int | None, kernel: VarlenKernel) -> Tensor:
    """The varlen kernel's call: (T, H, D) q and (T, H_kv, D) k/v -> (T, H, D); `window` as in
    `packed_causal_attention`."""
    left = -1 if window is None else window - 1
    if kernel == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len,
                                      softmax_scale=scale, causal=True, window_size=(left, 0))
    from torch.nn.attention.varlen import varlen_attn

    groups = query.shape[1] // key.shape[1]
    gqa: dict[str, Any] = {}
    if groups > 1 and _varlen_attn_takes_gqa():
        gqa["enable_gqa"] = True
    elif groups > 1:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                       window_size=(left, 0), **gqa)


_last_lengths: tuple[weakref.ref, int, list[int]] | None = None  # (cu_seqlens, its version, its lengths)


def _host_lengths(cu_seqlens: Tensor) -> list[int]:
    """The segment lengths on the host, read once per `cu_seqlens` tensor: every layer of a micro-batch passes
    the same one, and on CUDA (fp32 rows, which take this path) each read waits for the GPU. Inference
    tensors (rollout's prefill) are read every time."""
    global _last_lengths
    if cu_seqlens.is_inference():  # no version counter to tell an in-place change: read every time
        return torch.diff(cu_seqlens).tolist()
    if _last_lengths is not None and _last_lengths[0]() is cu_seqlens and _last_lengths[1] == cu_seqlens._version:
        return _last_lengths[2]
    lengths = torch.diff(cu_seqlens).tolist()
    _last_lengths = (weakref.ref(cu_seqlens), cu_seqlens._version, lengths)
    return lengths


def packed_causal_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, *,
                            max_len: int | None = None, scale: float | None = None, window: int | None = None,
                            dropout: float = 0.0, lengths: list[int] | None = None) -> Tensor:
    """Causal attention within each [cu[i], cu[i+1]) of q (T, H, D), k / v (T, H_kv, D) -> (T, H, D).

    `cu_seqlens` (S+1,) int32 ends at T (checked when it is on the host); `max_len` its longest segment
    (computed, with a host sync, when not given); `window`: HF's sliding window, a query sees itself and the window - 1 keys before it.
    `lengths`: the segment lengths, where the caller has them on the host (else read from `cu_seqlens`).
    """
    # Checked where it costs nothing: reading a GPU tensor here would stall the host once per layer.
    if cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != query.shape[0]:
        raise ValueError(f"packed attention needs segments covering the row: q {tuple(query.shape)} (T, H, D), "
                         f"cu_seqlens ends at {int(cu_seqlens[-1])}")
    if uses_varlen(query, dropout):
        max_len = max_len or int(torch.diff(cu_seqlens).max())
        return varlen_causal_attention(query, key, value, cu_seqlens, max_len, scale=scale, window=window,
                                       kernel=varlen_kernel("cuda"))
    lengths = lengths if lengths is not None else _host_lengths(cu_seqlens)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    # split (not slicing in a loop): its backward is one cat, not a zero-filled copy per segment
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # (1, H, L, D)
        n = q.shape[2]
        if window is None or n <= window:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            offsets = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
            band = (offsets >= 0) & (offsets < window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout, scale=scale,
                                                 enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
