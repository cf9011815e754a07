"""pack / pack_like / unpack / block_causal_mask: bit-exact round trips for several dtypes and trailing
shapes, layout fields against per-token loops written from the definitions, brute-force masks, a packed
sdpa forward against per-sequence sdpa, and input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import block_causal_mask, pack, pack_like, unpack

FAST = settings(max_examples=50, deadline=None)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.bool]


def _random(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-(2**30), 2**30, shape, generator=gen).to(dtype)


@st.composite
def packing_case(draw):
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    return (
        lengths,
        draw(st.sampled_from([(), (3,), (2, 2)])),  # trailing per-token shape
        draw(st.sampled_from(DTYPES)),
        draw(st.integers(1, 8)),  # pad_multiple
        draw(st.integers(1, 16)),  # total_multiple
        draw(st.integers(0, 2**31 - 1)),  # seed
    )


def reference_layout_fields(lengths, pad_multiple, total_multiple):
    """position_ids and seq_ids built token by token from the definitions."""
    pos, seq = [], []
    for i, n in enumerate(lengths):
        padded = -(-n // pad_multiple) * pad_multiple
        for t in range(padded):
            pos.append(t)
            seq.append(i if t < n else -1)
    tail = -len(pos) % total_multiple
    pos += list(range(tail))
    seq += [-1] * tail
    return pos, seq


@FAST
@given(case=packing_case())
def test_unpack_of_pack_is_bit_exact(case):
    lengths, rest, dtype, pad_multiple, total_multiple, seed = case
    gen = torch.Generator().manual_seed(seed)
    seqs = [_random((n, *rest), dtype, gen) for n in lengths]
    row, layout = pack(seqs, pad_multiple=pad_multiple, total_multiple=total_multiple, pad_value=7)
    assert row.shape == (layout.total_len, *rest) and row.dtype == dtype
    out = unpack(row, layout)
    assert len(out) == len(seqs)
    for a, b in zip(out, seqs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
        if dtype.is_floating_point:  # bit for bit, not just ==
            assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    # a second field (other dtype and trailing shape) in the same layout round-trips too
    labels = [torch.arange(n, dtype=torch.int64) * 10 + i for i, n in enumerate(lengths)]
    for a, b in zip(unpack(pack_like(labels, layout, pad_value=-100), layout), labels):
        assert torch.equal(a, b)


@FAST
@given(case=packing_case())
def test_layout_fields_match_definitions(case):
    lengths, _, _, pad_multiple, total_multiple, _ = case
    row, layout = pack(
        [torch.ones(n) for n in lengths], pad_multiple=pad_multiple, total_multiple=total_multiple
    )
    pos, seq = reference_layout_fields(lengths, pad_multiple, total_multiple)
    assert layout.total_len == len(pos) and layout.total_len % total_multiple == 0
    assert layout.position_ids.tolist() == pos
    assert layout.seq_ids.tolist() == seq
    assert layout.lengths == lengths
    assert all(p % pad_multiple == 0 and p - n < pad_multiple for p, n in zip(layout.padded_lengths, lengths))
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens_padded.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    starts = [sum(layout.padded_lengths[:i]) for i in range(len(lengths) + 1)]
    assert layout.cu_seqlens_padded.tolist() == starts
    assert row.sum().item() == sum(lengths)  # pad_value 0: only real tokens are ones


@FAST
@given(case=packing_case())
def test_block_causal_mask_matches_brute_force(case):
    lengths, _, _, pad_multiple, total_multiple, _ = case
    _, layout = pack(
        [torch.ones(n) for n in lengths], pad_multiple=pad_multiple, total_multiple=total_multiple
    )
    seq = layout.seq_ids.tolist()
    T = layout.total_len
    expected = [
        [(q == k) if seq[q] == -1 else (seq[k] == seq[q] and k <= q) for k in range(T)] for q in range(T)
    ]
    assert block_causal_mask(layout).tolist() == expected


def test_packed_sdpa_equals_per_sequence_sdpa():
    torch.manual_seed(0)
    heads, dim, lengths = 2, 8, [5, 1, 9, 4]
    qkv = [torch.randn(3, heads, n, dim) for n in lengths]  # per sequence: (3, H, L, D)
    # pack along the token axis: per-sequence (L, 3, H, D) -> one row (T, 3, H, D)
    row, layout = pack([x.permute(2, 0, 1, 3) for x in qkv], pad_multiple=4, pad_value=0.0)
    q, k, v = row.permute(1, 2, 0, 3)  # each (H, T, D)
    mask = block_causal_mask(layout)
    packed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (H, T, D)
    got = unpack(packed.permute(1, 0, 2), layout)  # [(L, H, D)]
    for (qi, ki, vi), out in zip(qkv, got):
        ref = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, is_causal=True)  # (H, L, D)
        # plain max-abs check: torch.testing.assert_close costs ~8 s of imports on first use
        assert out.shape == (ref.shape[1], heads, dim)
        assert (out.permute(1, 0, 2) - ref).abs().max().item() <= 1e-6
    assert torch.isfinite(packed).all()  # padding rows attend to themselves: no NaN anywhere


def test_pack_and_unpack_pass_gradients():
    seqs = [torch.randn(n, 2, dtype=torch.float64, requires_grad=True) for n in (3, 5)]
    row, layout = pack(seqs, pad_multiple=4)
    weights = torch.arange(row.numel(), dtype=torch.float64).view_as(row)
    (row * weights).sum().backward()
    for s, w in zip(seqs, unpack(weights, layout)):
        assert torch.equal(s.grad, w)


@pytest.mark.gpu
def test_layout_and_cp_stay_on_the_tensors_device():
    from seqpack import cp_gather, cp_shard

    seqs = [torch.randn(n, 4, device="cuda") for n in (3, 9, 2)]
    row, layout = pack(seqs, pad_multiple=4, total_multiple=8)
    for t in (row, layout.cu_seqlens, layout.cu_seqlens_padded, layout.position_ids, layout.seq_ids):
        assert t.device.type == "cuda"
    assert block_causal_mask(layout).device.type == "cuda"
    shards = [cp_shard(row, layout, 2, r) for r in range(2)]
    assert torch.equal(cp_gather(shards, layout, 2), row)
    assert all(torch.equal(a, b) for a, b in zip(unpack(row, layout), seqs))


def test_bad_input():
    with pytest.raises(ValueError, match="empty"):
        pack([])
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(0,\)"):
        pack([torch.ones(3), torch.ones(0)])
    with pytest.raises(ValueError, match="same trailing shape"):
        pack([torch.ones(3, 2), torch.ones(3, 4)])
    with pytest.raises(ValueError, match="pad_multiple must be >= 1"):
        pack([torch.ones(3)], pad_multiple=0)
    with pytest.raises(TypeError, match="list of per-sequence tensors"):
        pack(torch.ones(3, 4))
    _, layout = pack([torch.ones(3), torch.ones(5)])
    with pytest.raises(ValueError, match="got 1 tensors but the layout holds 2"):
        pack_like([torch.ones(3)], layout)
    with pytest.raises(ValueError, match=r"tensors\[1\] has 4 tokens but sequence 1 of the layout has 5"):
        pack_like([torch.ones(3), torch.ones(4)], layout)
    with pytest.raises(ValueError, match="total_len is 8"):
        unpack(torch.ones(7), layout)
