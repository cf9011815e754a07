"""PackedDotProductAttention on THD packed rows == megatron's own DotProductAttention run on each sequence
alone (float64, outputs and q/k/v gradients), with GQA, a 1-token sequence, sequences padded to the pack
multiple and a sliding window; padding positions receive no gradient from real tokens' outputs."""

from __future__ import annotations

import pytest
import torch

from rl_core.testing.distributed import run_distributed

LENGTHS = [5, 1, 9, 3]  # real tokens per sequence
MULTIPLE = 4  # each padded to a multiple of 4: segments [8, 4, 12, 4]
DIM = 8


def _compare(rank: int, world: int, heads: int, groups: int, window: int | None) -> dict[str, float]:
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from engine_megatron import packed_attention

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * DIM, num_attention_heads=heads, num_query_groups=groups,
                            params_dtype=torch.float64, attention_dropout=0.0,
                            window_size=None if window is None else (window - 1, 0))
    kwargs = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    reference, packed = DotProductAttention(**kwargs), packed_attention.PackedDotProductAttention(**kwargs)
    segments = [-(-n // MULTIPLE) * MULTIPLE for n in LENGTHS]
    starts = torch.tensor([0, *segments]).cumsum(0)
    real = torch.cat([torch.arange(int(s), int(s) + n) for s, n in zip(starts, LENGTHS)])  # real-token rows
    t = int(starts[-1])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, heads, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(t, groups, DIM, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(t, heads * DIM, generator=gen, dtype=torch.float64)
    weight[~torch.isin(torch.arange(t), real)] = 0  # padding outputs are dropped, as by the engine
    calls = []
    real_attention = packed_attention.packed_causal_attention

    def counting(*args, **kw):  # this rank is a forked process: the patch is local to it
        calls.append(kw["window"])
        return real_attention(*args, **kw)

    packed_attention.packed_causal_attention = counting
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=starts.int(),
                             cu_seqlens_kv_padded=starts.int(), max_seqlen_q=max(segments), max_seqlen_kv=max(segments))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = packed(*leaves, None, packed_seq_params=params).reshape(t, -1)  # (T, 1, hidden) -> (T, hidden)
    packed_grads = torch.autograd.grad((out * weight).sum(), leaves)
    diffs = {"calls": len(calls), "window": calls[0]}
    ref_out, ref_grads = torch.zeros_like(out), [torch.zeros_like(x) for x in (q, k, v)]
    for s, n in zip(starts.tolist(), LENGTHS):  # megatron's dense path, one sequence alone: (n, 1, heads, d)
        seq = [x[s:s + n, None].clone().requires_grad_(True) for x in (q, k, v)]
        o = reference(*seq, None)[:, 0]  # (n, hidden)
        for full, g in zip(ref_grads, torch.autograd.grad((o * weight[s:s + n]).sum(), seq)):
            full[s:s + n] = g[:, 0]
        ref_out[s:s + n] = o.detach()
    diffs["out"] = float((out[real] - ref_out[real]).abs().max())
    diffs["grads"] = max(float((a - b).abs().max()) for a, b in zip(packed_grads, ref_grads))  # padding: 0 in ref
    ps.destroy_model_parallel()
    return diffs


@pytest.mark.parametrize("heads,groups,window", [(4, 4, None), (4, 2, None), (4, 2, 3)])
def test_packed_attention_equals_megatron_attention_per_sequence(heads: int, groups: int, window: int | None) -> None:
    diffs = run_distributed(_compare, 1, args=(heads, groups, window))[0]
    assert diffs["out"] < 1e-12 and diffs["grads"] < 1e-12, diffs
    assert diffs["calls"] == 1 and diffs["window"] == window  # one packed call per row, megatron's window mapped
