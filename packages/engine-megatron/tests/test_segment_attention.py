"""SegmentDotProductAttention == megatron's dense masked DotProductAttention on packed rows (float64)."""

from __future__ import annotations

import pytest
import torch

from engine_megatron.segment_attention import block_causal_segments
from rl_core.testing.distributed import run_distributed


def _block_mask(lengths: list[int]) -> torch.Tensor:
    """(T, T) bool, True = masked: causal within each sequence, nothing across."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ~((seg[:, None] == seg[None, :]) & torch.ones(len(seg), len(seg), dtype=torch.bool).tril())


def test_segments_are_read_back_from_a_block_causal_mask() -> None:
    assert block_causal_segments(_block_mask([3, 1, 4])) == [3, 1, 4]
    not_block = _block_mask([3, 1, 4])
    not_block[7, 0] = False  # a token that sees into an earlier sequence
    assert block_causal_segments(not_block) is None


def _compare(rank: int, world: int, heads: int, groups: int, lengths: list[int]) -> list[float]:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from engine_megatron.segment_attention import SegmentDotProductAttention

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=heads * 8, num_attention_heads=heads, num_query_groups=groups,
                            params_dtype=torch.float64, attention_dropout=0.0)
    kwargs = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.padding, attention_type="self")
    dense, segment = DotProductAttention(**kwargs), SegmentDotProductAttention(**kwargs)
    t = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, 1, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(t, 1, groups, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(t, 1, heads * 8, generator=gen, dtype=torch.float64)
    not_block = _block_mask(lengths)
    not_block[t - 1, 0] = False  # the last token also sees the first: megatron's own path must run
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def counting_sdpa(*args, **kw):  # this rank is a forked process: patching torch here is local to it
        calls.append(1)
        return sdpa(*args, **kw)

    torch.nn.functional.scaled_dot_product_attention = counting_sdpa
    diffs = []
    for m in (_block_mask(lengths)[None, None], not_block[None, None]):
        results = []
        for module in (dense, segment):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            out = module(*leaves, m)
            grads = torch.autograd.grad((out * weight).sum(), leaves)
            results.append(torch.cat([out.flatten(), *(g.flatten() for g in grads)]))
        diffs.append(float((results[0] - results[1]).abs().max()))
        diffs.append(len(calls))
        calls.clear()
    ps.destroy_model_parallel()
    return diffs


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_segment_attention_equals_dense_masked_attention(heads: int, groups: int) -> None:
    packed, packed_calls, fallback, fallback_calls = run_distributed(_compare, 1, args=(heads, groups, [5, 1, 9, 3]))[0]
    assert packed < 1e-12 and packed_calls == 4  # one sdpa per sequence
    assert fallback == 0.0 and fallback_calls == 0  # not block-causal: megatron's dense path
