"""Micro-batch inputs: spans, next-token targets, pipeline padding and the context-parallel data path.

The model-level CP test needs a GPU (test_gpu.py); here the CP shard -> per-rank values -> all-gather ->
per-sequence path is checked on CPU with a stand-in for the model: per-position values computed from
the positions' own token and target, which must come back exactly as from the unsharded row.
"""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import VOCAB, make_policy

import seqpack
from engine_megatron import batching
from engine_megatron.config import ResolvedSettings
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.distributed import run_distributed


def _settings(packing: bool, tp: int = 1, cp: int = 1, sp: bool = False, use_cuda: bool = False,
              attention: str = "local") -> ResolvedSettings:
    pack = 2 * cp * tp if cp * tp > 1 else 1
    return ResolvedSettings(sequence_parallel=sp, packing=packing, pack_multiple=pack,
                            seq_multiple=pack if cp > 1 else (tp if sp else 1), transformer_overrides={},
                            use_cuda=use_cuda, attention=attention)


@pytest.mark.parametrize("attention", ["local", "transformer_engine"])
def test_packed_rows_carry_sequence_boundaries_and_no_mask(attention: str) -> None:
    """Both attentions get THD PackedSeqParams (O(S)); every tensor of a packed micro-batch is O(T)."""
    batch = random_token_batch(VOCAB, [3, 2])
    plan = seqpack.plan_micro_batches(batch.lengths, packing=True)
    (mb,) = batching.build_micro_batches(batch, plan, _settings(True, use_cuda=True, attention=attention),
                                         uniform_shape=False)
    params = mb.packed_seq_params
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 3, 5]
    assert params.cu_seqlens_q_padded.tolist() == [0, 3, 5] and params.max_seqlen_q == 3
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    tensors = [v for v in vars(mb).values() if torch.is_tensor(v)] + [v for v in vars(params).values()
                                                                      if torch.is_tensor(v)]
    assert max(t.numel() for t in tensors) == 5  # (1, T) rows, (S+1,) boundaries; no (T, T) mask


def test_packed_padding_and_pipeline_tail_belong_to_the_sequences() -> None:
    """TP=2 pads each sequence to a multiple of 4; a pipeline-uniform row's tail joins its last sequence."""
    batch = random_token_batch(VOCAB, [1, 5, 9, 2])
    plan = seqpack.plan_micro_batches(batch.lengths, max_tokens=20, packing=True, round_to=4)
    mbs = batching.build_micro_batches(batch, plan, _settings(True, tp=2, sp=True), uniform_shape=True)
    assert len(mbs) > 1 and len({mb.shape for mb in mbs}) == 1
    cols = mbs[0].shape[1]
    for mb in mbs:
        lengths = mb.batch.lengths
        padded = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
        assert mb.packed_seq_params.cu_seqlens_q.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
        assert padded[-1] == cols and all(p % 4 == 0 for p in padded)
        assert [b - a for a, b in zip(padded, padded[1:-1])] == [-(-n // 4) * 4 for n in lengths[:-1]]
        assert mb.packed_seq_params.max_seqlen_q == max(b - a for a, b in zip(padded, padded[1:]))


def te_thd_partition(cu_seqlens_padded: list[int], cp_size: int, cp_rank: int) -> list[int]:
    """Transformer Engine's THD context-parallel split, from its definition: every padded segment
    [cu[i], cu[i+1]) in 2*CP equal chunks, rank r keeping chunks r and 2*CP-1-r."""
    out = []
    for start, end in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
        chunk = (end - start) // (2 * cp_size)
        for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out += range(start + j * chunk, start + (j + 1) * chunk)
    return out


def test_pipeline_padded_packed_rows_split_for_context_parallel_as_te_does() -> None:
    """PP pads every packed row to one width; with CP each rank's shard must be the positions TE's THD
    attention computes from cu_seqlens_q_padded, and of one shape on every micro-batch (p2p sends)."""
    cp = 2
    batch = random_token_batch(VOCAB, [13, 3, 4, 2])
    plan = seqpack.plan_micro_batches(batch.lengths, max_tokens=16, packing=True, round_to=2 * cp)
    full = batching.build_micro_batches(batch, plan, _settings(True, cp=cp), uniform_shape=True)
    assert len(full) > 1 and len({mb.shape for mb in full}) == 1
    for rank in range(cp):
        shards = batching.build_micro_batches(batch, plan, _settings(True, cp=cp), uniform_shape=True,
                                              cp_rank=rank, cp_size=cp)
        assert {mb.shape for mb in shards} == {(1, full[0].shape[1] // cp)}
        for whole, shard in zip(full, shards):
            index = te_thd_partition(shard.packed_seq_params.cu_seqlens_q_padded.tolist(), cp, rank)
            assert shard.tokens[0].tolist() == whole.tokens[0, index].tolist()
            assert shard.targets[0].tolist() == whole.targets[0, index].tolist()


def _stand_in(mb: batching.MicroBatch) -> torch.Tensor:
    """A per-position value that depends on the token and its target, (B, S) float64."""
    return mb.tokens.double() * 1000 + mb.targets.double()


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("uniform", [False, True])
def test_spans_and_targets_read_back_each_sequence(packing: bool, uniform: bool) -> None:
    batch = random_token_batch(VOCAB, [5, 9, 7, 12, 3])
    settings = _settings(packing, tp=2, sp=True)
    plan = seqpack.plan_micro_batches(batch.lengths, max_tokens=20, packing=packing, round_to=2)
    mbs = batching.build_micro_batches(batch, plan, settings, uniform_shape=uniform)
    if uniform:
        assert len({mb.shape for mb in mbs}) == 1
    assert all(mb.shape[1] % 2 == 0 for mb in mbs), "sequence parallel needs S divisible by TP"
    out = plan.restore([batching.per_sequence(_stand_in(mb), mb) for mb in mbs])
    for ids, values in zip(batch.input_ids, out):
        expected = torch.cat([torch.zeros(1, dtype=torch.float64), ids[:-1].double() * 1000 + ids[1:].double()])
        assert torch.equal(values, expected)  # position t holds (token t-1, target t): aligned, 0 at t=0


def _cp_worker(rank: int, world_size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    batch = random_token_batch(VOCAB, [5, 9, 7, 12, 3], seed=4)
    plan = seqpack.plan_micro_batches(batch.lengths, packing=True, round_to=2 * world_size)
    (mb,) = batching.build_micro_batches(batch, plan, _settings(True, cp=world_size), uniform_shape=False,
                                         cp_rank=rank, cp_size=world_size)
    local = _stand_in(mb).requires_grad_(True)  # (1, T/CP): this rank's chunks only
    full = batching.gather_cp(local, mb, dist.group.WORLD)
    full.sum().backward()  # every rank holds the full row: each local value's grad is world_size
    assert torch.equal(local.grad, torch.full_like(local, float(world_size)))
    return plan.restore([batching.per_sequence(full.detach(), mb)])


@pytest.mark.distributed
def test_context_parallel_shard_and_gather_restore_every_sequence() -> None:
    batch = random_token_batch(VOCAB, [5, 9, 7, 12, 3], seed=4)
    for per_rank in run_distributed(_cp_worker, world_size=2):
        for ids, values in zip(batch.input_ids, per_rank):
            expected = torch.cat([torch.zeros(1, dtype=torch.float64), ids[:-1].double() * 1000 + ids[1:].double()])
            assert torch.equal(values, expected)


def test_plan_uses_the_configured_budget() -> None:
    batch = random_token_batch(VOCAB, [5, 9, 7, 12, 3])
    padded = batching.plan(batch, make_policy("x", train_micro_batch_size=2), _settings(False), training=True)
    assert [len(mb) for mb in padded.micro_batches] == [2, 2, 1]
    packed = batching.plan(batch, make_policy("x", sequence_packing={"enabled": True, "train_mb_tokens": 16}),
                           _settings(True), training=True)
    assert all(sum(batch.lengths[i] for i in mb) <= 16 for mb in packed.micro_batches)
