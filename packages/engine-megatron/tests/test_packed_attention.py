"""PackedDotProductAttention on THD packed rows == megatron's own DotProductAttention run on each sequence
alone (float64, outputs and q/k/v gradients), with GQA, a 1-token sequence, sequences padded to the pack
multiple and a sliding window; padding positions receive no gradient from real tokens' outputs."""

from __future__ import annotations

import logging

import pytest
import torch

from rl_core.testing.distributed import run_distributed

LENGTHS = [5, 1, 9, 3]  # real tokens per sequence
MULTIPLE = 4  # each padded to a multiple of 4: segments [8, 4, 12, 4]
DIM = 8
logger = logging.getLogger(__name__)


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


class _NoContextParallel:  # megatron's rope reads the CP group's size and rank
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("interleaved,mscale,rot_dim", [(False, 1.0, DIM), (True, 1.3, DIM), (False, 1.0, DIM // 2)])
def test_one_call_thd_rope_equals_megatron_thd_rope(interleaved: bool, mscale: float, rot_dim: int) -> None:
    """The one-call rope == megatron's per-sequence THD rope (float64; 1-token and padded segments, one
    sequence as long as the freqs, partial rotary dims), its op count does not grow with the number of
    sequences, it reads nothing on the host (megatron's reads the lengths: a sync per layer on CUDA), and
    a second call on the same micro-batch (k after q, the next layer) reuses the cos / sin tables, but not
    after the lengths changed in place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine_megatron.packed_attention import _MEGATRON_THD_ROPE, one_call_thd_rope

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = self.host_reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            self.host_reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    kw = dict(cp_group=_NoContextParallel(), rotary_interleaved=interleaved, mscale=mscale)
    first_calls, next_calls = [], []
    for lengths in ([16], [3] * 40, [8, 4, 12, 4, 1]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        freqs = torch.randn(max(lengths), 1, 1, rot_dim, generator=gen, dtype=torch.float64)
        for calls in (first_calls, next_calls):
            t = torch.randn(sum(lengths), 4, DIM, generator=gen, dtype=torch.float64)
            with CountOps() as ops:
                got = one_call_thd_rope(_MEGATRON_THD_ROPE, t, cu, freqs, **kw)
            calls.append(ops.count)
            assert ops.host_reads == 0, lengths
            assert torch.equal(got, _MEGATRON_THD_ROPE(t, cu, freqs, **kw)), lengths
    assert first_calls[1] == first_calls[2] and max(first_calls) <= 30, first_calls
    assert max(next_calls) <= 12 and max(next_calls) < min(first_calls) - 8, (first_calls, next_calls)
    cu[1:3] = torch.tensor([2, 12], dtype=torch.int32)  # the same tensor, new lengths: the tables are made again
    t = torch.randn(29, 4, DIM, generator=gen, dtype=torch.float64)
    assert torch.equal(one_call_thd_rope(_MEGATRON_THD_ROPE, t, cu, freqs, **kw), _MEGATRON_THD_ROPE(t, cu, freqs, **kw))


def _compare_padded(rank: int, world: int, groups: int, dtype: torch.dtype) -> dict:
    """Padded rows (S, B, heads, d) through PackedDotProductAttention vs megatron's own attention: outputs,
    q/k/v grads, and the largest tensor each creates (forward + backward)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from engine_megatron.packed_attention import PackedDotProductAttention
    from rl_core.testing.memory import LargestTensors

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    heads, seq, rows = 4, PADDED_S, 2
    cfg = TransformerConfig(num_layers=3, hidden_size=heads * DIM, num_attention_heads=heads, num_query_groups=groups,
                            params_dtype=dtype, attention_dropout=0.0, apply_query_key_layer_scaling=True)
    kwargs = dict(config=cfg, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, rows, heads, DIM, generator=gen, dtype=dtype)
    k, v = (torch.randn(seq, rows, groups, DIM, generator=gen, dtype=dtype) for _ in range(2))
    weight = torch.randn(seq, rows, heads * DIM, generator=gen, dtype=dtype)
    results = {}
    for name, attention in (("ours", PackedDotProductAttention(**kwargs)), ("megatron", DotProductAttention(**kwargs))):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        with LargestTensors() as seen:
            out = attention(*leaves, None)
            grads = torch.autograd.grad((out * weight).sum(), leaves)
        results[name] = (out.detach(), grads, max(seen.largest.values())[0])  # numel
    ps.destroy_model_parallel()
    (out, grads, largest), (ref_out, ref_grads, ref_largest) = results["ours"], results["megatron"]
    return {"out": float((out - ref_out).abs().max()),
            "grads": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)),
            "largest": largest, "megatron_largest": ref_largest}


PADDED_S = 96


@pytest.mark.parametrize("groups", [4, 2])
def test_padded_rows_take_one_causal_sdpa_equal_to_megatron_attention(groups: int) -> None:
    """Padded micro-batches (megatron's causal mask type, no mask tensor): the same outputs and q/k/v grads
    as megatron's unfused attention in float64 (GQA, query-key layer scaling), and in float32 no tensor
    of S x S elements, where megatron's own keeps the (B x heads, S, S) scores."""
    diffs = run_distributed(_compare_padded, 1, args=(groups, torch.float64))[0]
    assert diffs["out"] < 1e-12 and diffs["grads"] < 1e-12, diffs
    sizes = run_distributed(_compare_padded, 1, args=(groups, torch.float32))[0]
    assert sizes["megatron_largest"] >= 2 * 4 * PADDED_S**2, sizes  # the check can fail: megatron's does
    assert sizes["largest"] < PADDED_S**2, sizes


# ---- the engine: packed == padded, and no (T, T) tensor ----------------------------------------------------

ENGINE_LENGTHS = [1, 6, 9, 2, 13, 3, 7, 1]  # 1-token sequences; TP=2 pads each to a multiple of 4
PACKING = {"sequence_packing": {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 30}}


def _logprobs_and_grads(rank: int, world: int, ckpt: str, tp: int, policy_kw: dict) -> tuple:
    from megatron_testutil import LOSS, global_batch, make_policy

    from engine_megatron import packed_attention
    from engine_megatron.engine import MegatronEngine
    from engine_megatron.model import gpt_model
    from rl_core.losses import ClippedPGLoss

    calls = []
    real_attention = packed_attention.packed_causal_attention

    def counting(*args, **kw):  # forked rank: the patch is local to it
        calls.append(1)
        return real_attention(*args, **kw)

    packed_attention.packed_causal_attention = counting
    engine = MegatronEngine(make_policy(ckpt, {"tensor_model_parallel_size": tp}, **policy_kw))
    batch = global_batch(0, ENGINE_LENGTHS)
    logprobs = engine.compute_logprobs(batch)
    engine.zero_grad()
    engine.forward_backward(batch.with_fields(prev_logprobs=[lp - 0.1 for lp in logprobs]), ClippedPGLoss(LOSS))
    grads = {name: p.main_grad.clone() for name, p in gpt_model(engine.model).named_parameters()}
    return logprobs, grads, len(calls)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2_sp"])
def test_packed_engine_equals_padded(tiny_ckpt, tp: int) -> None:
    """fp32 logprobs and every parameter's gradient of packed rows (THD through PackedDotProductAttention,
    rope restarting per sequence) equal padded rows (one causal sdpa over the padded micro-batch, itself
    checked against megatron's attention above)."""
    ckpt = tiny_ckpt("qwen2")
    packed = run_distributed(_logprobs_and_grads, tp, args=(ckpt, tp, PACKING))
    padded = run_distributed(_logprobs_and_grads, tp, args=(ckpt, tp, {}))
    for (lp, grads, calls), (ref_lp, ref_grads, ref_calls) in zip(packed, padded):
        assert calls > 0 and ref_calls == 0  # packed rows took the packed path, padded rows not
        assert [x.numel() for x in lp] == ENGINE_LENGTHS
        lp_diff = max(float((a - b).abs().max()) for a, b in zip(lp, ref_lp))
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        grad_diff = max(float((grad - ref_grads[name]).abs().max()) for name, grad in grads.items()) / scale
        logger.info("packed vs padded, TP=%d: logprobs %.1e, grads %.1e of the largest", tp, lp_diff, grad_diff)
        assert lp_diff <= 2e-6 and grad_diff <= 1e-5, (lp_diff, grad_diff)


def _largest_tensors(rank: int, world: int, ckpt: str, lengths: list[int]) -> dict:
    from megatron_testutil import LOSS, global_batch, make_policy

    from engine_megatron.engine import MegatronEngine
    from rl_core.losses import ClippedPGLoss
    from rl_core.testing.memory import LargestTensors

    tokens = sum(lengths)
    engine = MegatronEngine(make_policy(ckpt, sequence_packing={"enabled": True, "train_mb_tokens": tokens,
                                                                "logprob_mb_tokens": tokens}))
    batch = global_batch(0, lengths)
    with LargestTensors() as seen:
        logprobs = engine.compute_logprobs(batch)
        result = engine.forward_backward(batch.with_fields(prev_logprobs=logprobs), ClippedPGLoss(LOSS))
    return {"largest": seen.largest, "micro_batches": result.num_micro_batches}


@pytest.mark.distributed
def test_packed_forward_backward_creates_no_t_by_t_tensor(tiny_ckpt) -> None:
    """One 2048-token packed row of 128 sequences: the biggest tensor any op creates (forward and backward,
    every dtype) is T x the model's widest layer (the fused gate/up projection, 2 x intermediate), a
    quarter of the T^2 a block-diagonal mask would take, and none has two sides of length T."""
    from rl_core.testing.tiny_models import tiny_config

    lengths = [16] * 128
    t = sum(lengths)
    widest = max(2 * tiny_config("qwen2").intermediate_size, 128)  # fc1 (gate + up), or the padded vocab
    assert widest * t <= t * t // 4
    out = run_distributed(_largest_tensors, 1, args=(tiny_ckpt("qwen2"), lengths))[0]
    assert out["micro_batches"] == 1
    for dtype, (numel, shape, op) in out["largest"].items():
        assert numel <= widest * t and list(shape).count(t) <= 1, (dtype, shape, op)
