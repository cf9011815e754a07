"""sdpa_segments: per-sequence causal attention over a packed row, checked against a float64 softmax."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine_dtensor.attention import segment_sdpa_forward
from engine_dtensor.forward import build_packed_inputs


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], window: int | None) -> torch.Tensor:
    """Explicit scores / causal block mask / softmax in float64, GQA by repeating kv heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    t = q.shape[2]
    seg = torch.zeros(t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        seg[s:e] = i
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    if window is not None:  # key j visible from query i iff i - window < j <= i
        allowed &= torch.ones(t, t, dtype=torch.bool).triu(-(window - 1))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2)  # (1, T, H, D)


@pytest.mark.parametrize("window", [None, 4, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_segment_attention_matches_float64_reference(heads: int, kv_heads: int, window: int | None) -> None:
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]  # includes a 1-token segment
    q = torch.randn(1, heads, 32, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, 32, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, 32, 8, dtype=torch.float64, requires_grad=True)
    module = nn.Module().eval()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out, _ = segment_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu_t, sliding_window=window)
    ref = _reference(q, k, v, cu, window)
    assert out.shape == (1, 32, heads, 8)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    seed = torch.Generator().manual_seed(1)
    weight = torch.randn(out.shape, generator=seed, dtype=torch.float64)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_segments_must_cover_the_row() -> None:
    q = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q ends at 8"):
        segment_sdpa_forward(nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3, 8]))


def test_packed_inputs_give_segments_not_a_mask() -> None:
    """Each sequence with its padding is one segment and the tail padding is the last one."""
    seqs = [torch.arange(5), torch.arange(3), torch.arange(6)]
    inputs = build_packed_inputs(seqs, attn_impl="sdpa_segments", seq_multiple=4, device=torch.device("cpu"))
    assert inputs.attention_mask is None
    assert inputs.attention_kwargs["cu_seq_lens_q"].tolist() == [0, 5, 8, 14, 16]
    assert inputs.input_ids.shape == (1, 16)


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

    from engine_dtensor.attention import varlen_causal_attention

    monkeypatch.setattr(varlen, "varlen_attn", _flash_semantics_varlen_attn)
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]
    q, k, v = (torch.randn(1, h, 32, 8, dtype=torch.float64) for h in (4, 2, 2))
    out = varlen_causal_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                  torch.tensor(cu, dtype=torch.int32), 13, scale=None, window=window, kernel="torch")
    torch.testing.assert_close(out[None], _reference(q, k, v, cu, window), rtol=1e-10, atol=1e-10)


def test_varlen_kernel_choice(monkeypatch) -> None:
    import sys
    import types

    from engine_dtensor import attention

    attention.varlen_kernel.cache_clear()
    try:
        assert attention.varlen_kernel("cpu") == "none"
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: torch's kernel
        assert attention.varlen_kernel("cuda") == "torch"
        attention.varlen_kernel.cache_clear()
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
        assert attention.varlen_kernel("cuda") == "flash_attn"
        # CPU tensors (and float32, dropout) keep the per-sequence sdpa whatever is installed
        assert not attention._uses_varlen(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), 0.0)
    finally:
        attention.varlen_kernel.cache_clear()
