"""seqpack.attention: the varlen kernel call and the kernel choice. Per-sequence sdpa is checked against a
float64 softmax through the engines' attention functions (engine-dtensor's test_attention, engine-megatron's
packed tests); here the CUDA-only varlen call is checked against its documented semantics."""

from __future__ import annotations

import pytest
import torch

from seqpack import attention
from seqpack.attention import packed_causal_attention, varlen_causal_attention
from seqpack.testing import reference_packed_attention as _reference


@pytest.mark.parametrize("window", [None, 4, 100])
def test_per_sequence_path_matches_float64_reference(window: int | None) -> None:
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]
    q, k, v = (torch.randn(32, h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    out = packed_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), window=window)
    ref = _reference(q, k, v, cu, window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for g, r in zip(torch.autograd.grad((out * weight).sum(), (q, k, v)),
                    torch.autograd.grad((ref * weight).sum(), (q, k, v))):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def _flash_semantics_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                                 enable_gqa=False):
    """torch's varlen_attn as documented, in float64 on CPU: (T, H, D); window_size (left, right), where
    (W, 0) lets query i see keys i-W..i; K/V heads must equal Q heads unless enable_gqa."""
    assert window_size[1] == 0 and max_q == max(int(b - a) for a, b in zip(cu_q[:-1], cu_q[1:]))
    if k.shape[1] != q.shape[1]:
        assert enable_gqa
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        n = b - a
        offsets = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        allowed = (offsets >= 0) & ((offsets <= window_size[0]) if window_size[0] >= 0 else True)
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * (scale or q.shape[-1] ** -0.5)
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v[a:b])
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_torch_varlen_call_translates_window_and_gqa(monkeypatch, window: int | None) -> None:
    """varlen_attn runs only on CUDA: check our call (window - 1, GQA, (T, H, D) layout) against the
    documented semantics, and those against the float64 reference of HF's attention."""
    from torch.nn.attention import varlen

    monkeypatch.setattr(varlen, "varlen_attn", _flash_semantics_varlen_attn)
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]
    q, k, v = (torch.randn(32, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    out = varlen_causal_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 13, scale=None, window=window,
                                  kernel="torch")
    torch.testing.assert_close(out, _reference(q, k, v, cu, window), rtol=1e-10, atol=1e-10)


def test_varlen_kernel_choice(monkeypatch) -> None:
    import sys
    import types

    attention.varlen_kernel.cache_clear()
    try:
        assert attention.varlen_kernel("cpu") == "none"
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: torch's kernel
        assert attention.varlen_kernel("cuda") == "torch"
        attention.varlen_kernel.cache_clear()
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
        assert attention.varlen_kernel("cuda") == "flash_attn"
        # CPU tensors (and float32, dropout) keep the per-sequence sdpa whatever is installed
        assert not attention.uses_varlen(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 0.0)
    finally:
        attention.varlen_kernel.cache_clear()


def test_segments_must_cover_the_row() -> None:
    q = torch.zeros(10, 2, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 8"):
        packed_causal_attention(q, q, q, torch.tensor([0, 3, 8]))


def test_per_sequence_path_reads_the_lengths_once_per_cu_seqlens() -> None:
    """Every layer of a micro-batch passes the same `cu_seqlens`; on CUDA in fp32 (this path) each read of it
    waits for the GPU, so it is read once, and again only for another tensor or after an in-place change."""
    from torch.overrides import TorchFunctionMode

    class CountToList(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.Tensor.tolist
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with CountToList() as reads:
        for _ in range(3):  # three layers
            out = packed_causal_attention(q, k, v, cu)
    assert reads.count == 1
    torch.testing.assert_close(out, _reference(q, k, v, [0, 5, 12], None), rtol=1e-12, atol=1e-12)
    cu[1] = 7  # the same tensor, new boundaries
    with CountToList() as reads:
        out = packed_causal_attention(q, k, v, cu)
    assert reads.count == 1
    torch.testing.assert_close(out, _reference(q, k, v, [0, 7, 12], None), rtol=1e-12, atol=1e-12)
