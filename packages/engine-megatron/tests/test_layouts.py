"""Parallel layouts change no result: each run is compared with the single-rank, padded, no-recompute run.

Every run loads the same tiny HF checkpoint, computes logprobs of a fixed 8-sequence batch (each DP rank
its shard), takes one ClippedPGLoss + AdamW step (clipped: grad norm ~5.5 > 1.0) and exports HF weights.
Compared: logprobs before and after the step, loss, grad norm, exported weights (megatron_testutil).
The 1-rank run is itself checked against the HF model (test_logprobs_match_hf).
"""

from __future__ import annotations

import logging

import pytest
import torch
from megatron_testutil import (
    LOSS,
    assert_layout,
    assert_same_run,
    by_index,
    dp_indices,
    engine_run,
    global_batch,
    hf_target_logprobs,
    make_policy,
    max_abs_diff,
    reference_run,
    weight_diffs,
)

from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

logger = logging.getLogger(__name__)

PACKING = {"sequence_packing": {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 30}}
DYNAMIC = {"dynamic_batching": {"enabled": True, "train_mb_tokens": 24, "logprob_mb_tokens": 30,
                                "sequence_length_round": 4}}


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logprobs_match_hf(tiny_ckpt, arch: str) -> None:
    """Converted checkpoint + megatron forward == the HF model forward (independent reference)."""
    ckpt = tiny_ckpt(arch)
    ref = dict(enumerate(hf_target_logprobs(ckpt, global_batch(0))))
    diff = max_abs_diff(by_index(reference_run(ckpt), "before"), ref)
    logger.info("%s megatron vs HF logprobs: max |diff| = %.2e", arch, diff)
    assert diff <= 1e-5


def _logprobs_at(rank: int, world_size: int, ckpt: str, temperature: float) -> list[torch.Tensor]:
    from engine_megatron.engine import MegatronEngine

    return MegatronEngine(make_policy(ckpt, temperature=temperature)).compute_logprobs(global_batch(0))


@pytest.mark.distributed
def test_temperature_divides_logits(tiny_ckpt) -> None:
    """policy.temperature != 1: log softmax(logits / T) of the HF model (fp64, one sequence at a time)."""
    ckpt = tiny_ckpt("llama")
    (got,) = run_distributed(_logprobs_at, 1, args=(ckpt, 0.7))
    ref = hf_target_logprobs(ckpt, global_batch(0), temperature=0.7)
    assert max_abs_diff(dict(enumerate(got)), dict(enumerate(ref))) <= 1e-5


def _truncated_logprobs_at(rank: int, world_size: int, ckpt: str) -> list[torch.Tensor]:
    from engine_megatron.engine import MegatronEngine

    policy = make_policy(ckpt, {"tensor_model_parallel_size": world_size}, temperature=0.8, top_k=40, top_p=0.7,
                         logprob_chunk_tokens=7)
    return MegatronEngine(policy).compute_logprobs(global_batch(0))


@pytest.mark.distributed
def test_top_k_top_p_logprobs_are_of_the_truncated_distribution(tiny_ckpt) -> None:
    """policy.top_k / top_p at TP=2 (vocab-parallel logits, padded vocabulary): the log-softmax over the tokens
    the sampler keeps, against the float64 HF reference from the definition; not the full-vocabulary one."""
    ckpt = tiny_ckpt("llama")
    got = dict(enumerate(run_distributed(_truncated_logprobs_at, 2, args=(ckpt,))[0]))
    ref = dict(enumerate(hf_target_logprobs(ckpt, global_batch(0), temperature=0.8, top_k=40, top_p=0.7)))
    assert max_abs_diff(got, ref) <= 1e-5
    assert max_abs_diff(got, dict(enumerate(hf_target_logprobs(ckpt, global_batch(0), temperature=0.8)))) > 0.1


LAYOUTS = {
    "tp2": (2, {"tensor_model_parallel_size": 2}, {}),  # sequence parallel on by default with TP>1
    "tp2_sp_off": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": False}, {}),
    "dp2": (2, {}, {}),
    # set in one of megatron's two places, the other follows (with only the optimizer's, DDP reduce-scattered the
    # grads and the whole-buffer optimizer read half of them unreduced: grad norm 3.65 on one rank, 5.22 on the other)
    "dp2_optimizer_not_distributed": (2, {"optimizer": {"use_distributed_optimizer": False}}, {}),
    "dp2_ddp_not_distributed": (2, {"distributed_data_parallel_config": {"use_distributed_optimizer": False}}, {}),
    "recompute_full": (1, {"activation_checkpointing": {"enabled": True, "granularity": "full"}}, {}),
    "recompute_selective": (1, {"activation_checkpointing": {"enabled": True, "granularity": "selective"}}, {}),
    "packed": (1, {}, PACKING),
    "packed_tp2_dp1": (2, {"tensor_model_parallel_size": 2}, PACKING),
    "packed_dp2": (2, {}, PACKING),
    # megatron's checkpointed core attention hands packed_seq_params to PackedDotProductAttention again
    "packed_recompute_selective": (1, {"activation_checkpointing": {"enabled": True, "granularity": "selective"}},
                                   PACKING),
    "dynamic_batching": (1, {}, DYNAMIC),
    "pp2": (2, {"pipeline_model_parallel_size": 2}, {}),
    "pp2_packed": (2, {"pipeline_model_parallel_size": 2}, PACKING),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_equals_single_rank(tiny_ckpt, layout: str) -> None:
    world, megatron_cfg, policy_kw = LAYOUTS[layout]
    ckpt = tiny_ckpt("qwen2")
    run = run_distributed(engine_run, world_size=world, args=(ckpt, megatron_cfg, policy_kw))
    assert_layout(run, world, megatron_cfg, policy_kw, reference_run(ckpt))
    diffs = assert_same_run(run, reference_run(ckpt))
    logger.info("qwen2 %s vs 1 rank: %s", layout, diffs)


@pytest.mark.distributed
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_sequence_level_aggregation_across_dp(tiny_ckpt, agg: str) -> None:
    """DP=2 == 1 rank for the sequence-level aggregations: their normaliser is the number of sequences of
    the GLOBAL batch (all-reduced over DP), where each rank holds half of them. A rank-local count would
    double loss and grad norm here (the update itself hides it: clipping and Adam are scale-free)."""
    ckpt = tiny_ckpt("qwen2")
    ref = reference_run(ckpt, agg=agg)
    losses = {reference_run(ckpt, agg=a)[0]["metrics"][0]["loss"] for a in ("token-mean", agg)}
    assert len(losses) == 2, "the aggregation should change the loss, else this case checks nothing"
    run = run_distributed(engine_run, world_size=2, args=(ckpt, {}, {}, 1, True, 0, False, agg))
    assert_layout(run, 2, {}, {}, ref)
    diffs = assert_same_run(run, ref)
    logger.info("qwen2 DP=2 %s vs 1 rank: %s", agg, diffs)


def _steps_of_two_sizes(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> dict:
    """Two train steps, the second on the first half of this rank's shard: fewer micro-batches than the
    first (globally: sequences 0-7, then 0-3, whatever the DP size, as the shards are interleaved)."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, megatron_cfg))
    batch = global_batch(0)
    indices = dp_indices(len(batch), engine.dp_rank, engine.dp_size)
    metrics = []
    for part in (indices, indices[: len(indices) // 2]):
        mine = batch.select(part)
        mine = mine.with_fields(prev_logprobs=engine.compute_logprobs(mine))
        metrics.append(engine.train_batch(mine, ClippedPGLoss(LOSS)))
    return {"metrics": metrics, "weights": dict(engine.export_hf_weights())}


@pytest.mark.distributed
def test_overlapped_grad_reduce_equals_single_rank(tiny_ckpt) -> None:
    """DP=2 with megatron's overlap_grad_reduce (each bucket's all-reduce launched during the last micro-batch's
    backward) == one rank, over a step of 2 micro-batches and one of 1 (megatron failed at the second without
    the schedule's no_sync: 'Communication call has not been issued for this bucket')."""
    ckpt = tiny_ckpt("qwen2")
    ref = run_distributed(_steps_of_two_sizes, world_size=1, args=(ckpt, {}))[0]
    cfg = {"distributed_data_parallel_config": {"overlap_grad_reduce": True, "bucket_size": 20000}}
    run = run_distributed(_steps_of_two_sizes, world_size=2, args=(ckpt, cfg))
    assert [m["num_micro_batches"] for m in run[0]["metrics"]] == [2, 1]
    for step, (m, m_ref) in enumerate(zip(run[0]["metrics"], ref["metrics"])):
        assert abs(m["loss"] - m_ref["loss"]) <= 1e-6 and m_ref["grad_norm"] > 0.1, (step, m, m_ref)
        assert abs(m["grad_norm"] - m_ref["grad_norm"]) <= 1e-6 * m_ref["grad_norm"], (step, m, m_ref)
    rel, absolute = weight_diffs(run[0]["weights"], ref["weights"])
    assert rel <= 1e-6 and absolute <= 1e-5, (rel, absolute)


@pytest.mark.distributed
@pytest.mark.parametrize("megatron_cfg", [{}, {"expert_model_parallel_size": 2}], ids=["dense", "moe_ep2"])
def test_uneven_dp_shards_run_dummy_micro_batches(tiny_ckpt, megatron_cfg: dict) -> None:
    """DP rank 1 holds 1 sequence, rank 0 seven: rank 1 runs zero-weight dummies, results are unchanged."""
    ckpt = tiny_ckpt("qwen3_moe" if megatron_cfg else "qwen2")
    run = run_distributed(_uneven_run, world_size=2, args=(ckpt, megatron_cfg))
    assert [len(r["indices"]) for r in run] == [7, 1]
    assert_layout(run, 2, megatron_cfg, {}, reference_run(ckpt))
    diffs = assert_same_run(run, reference_run(ckpt))
    logger.info("%s uneven DP shards vs 1 rank: %s", "qwen3_moe EP=2" if megatron_cfg else "qwen2", diffs)


def _uneven_run(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> dict:
    return engine_run(rank, world_size, ckpt, megatron_cfg, {}, uneven=True)


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("megatron_cfg", [{"expert_model_parallel_size": 2}, {"tensor_model_parallel_size": 2}],
                         ids=["ep2", "tp2"])
def test_expert_parallel_equals_single_rank(tiny_ckpt, arch: str, megatron_cfg: dict) -> None:
    """EP=2 (x DP=2 for the dense part), and TP=2 with the experts TP-sharded too (expert TP = TP, the
    default), == one rank; qwen3_moe also against HF."""
    ckpt = tiny_ckpt(arch)
    ref = reference_run(ckpt)
    if arch == "qwen3_moe":
        hf = dict(enumerate(hf_target_logprobs(ckpt, global_batch(0))))
        assert max_abs_diff(by_index(ref, "before"), hf) <= 1e-5
    run = run_distributed(engine_run, world_size=2, args=(ckpt, megatron_cfg, {}))
    assert_layout(run, 2, megatron_cfg, {}, ref)
    diffs = assert_same_run(run, ref)
    logger.info("%s %s vs one rank: %s", arch, megatron_cfg, diffs)


def _recompute_settings(rank: int, world_size: int, ckpt: str) -> tuple:
    from megatron_testutil import make_policy

    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {"activation_checkpointing": {"enabled": True, "num_layers": 1}}))
    config = engine.model.module.config
    return config.recompute_granularity, config.recompute_method, config.recompute_num_layers


@pytest.mark.distributed
def test_recompute_is_configured(tiny_ckpt) -> None:
    """The recompute runs above really recompute (megatron reads these fields in TransformerBlock)."""
    assert run_distributed(_recompute_settings, world_size=1, args=(tiny_ckpt("qwen2"),)) == [("full", "uniform", 1)]


@pytest.mark.distributed
def test_bf16_tracks_fp32(tiny_ckpt) -> None:
    """policy.precision=bfloat16 (Float16Module, fp32 main params) stays within bf16 error of fp32, TP=2."""
    ckpt = tiny_ckpt("qwen2")
    run = run_distributed(engine_run, world_size=2,
                          args=(ckpt, {"tensor_model_parallel_size": 2}, {"precision": "bfloat16"}))
    ref = reference_run(ckpt)
    assert_layout(run, 2, {"tensor_model_parallel_size": 2}, {}, ref)
    logprobs = max_abs_diff(by_index(run, "before"), by_index(ref, "before"))
    m, m_ref = run[0]["metrics"][0], ref[0]["metrics"][0]
    assert logprobs <= 0.05 and abs(m["grad_norm"] / m_ref["grad_norm"] - 1) <= 1e-2, (logprobs, m, m_ref)
    assert {t.dtype for t in run[0]["weights"].values()} == {torch.bfloat16}
    logger.info("qwen2 bf16 TP=2 vs fp32: logprobs %.2e, grad norm %.4f vs %.4f", logprobs, m["grad_norm"],
                m_ref["grad_norm"])


def _train_on_pad_tokens(rank: int, world_size: int, ckpt: str, megatron_cfg: dict | None) -> dict | None:
    """One step on a batch whose sequences hold the pad token (id 0 in the tiny models: a sampler may emit it);
    megatron_cfg None: the DTensor engine (HF's modules). The exported weights (rank 0)."""
    batch = global_batch(0)
    ids = [t.clone() for t in batch.input_ids]
    for t in ids:
        t[len(t) // 2] = 0  # inside the completion: trained on
    batch = batch.with_fields(input_ids=ids)
    if megatron_cfg is None:
        from engine_dtensor.engine import DTensorEngine

        policy = make_policy(ckpt)
        policy.megatron_cfg, policy.dtensor_cfg = {"enabled": False}, {"enabled": True}
        engine = DTensorEngine(policy)
    else:
        from engine_megatron.engine import MegatronEngine

        engine = MegatronEngine(make_policy(ckpt, megatron_cfg))
    engine.train_batch(batch.select(dp_indices(len(batch), engine.dp_rank, engine.dp_size)), ClippedPGLoss(LOSS))
    weights = {name: tensor.clone() for name, tensor in engine.export_hf_weights()}
    return weights if rank == 0 else None


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, megatron_cfg", [
    (1, {}), (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True})])
def test_the_pad_tokens_embedding_row_trains_as_in_hf(tiny_ckpt, world_size: int, megatron_cfg: dict) -> None:
    """HF's embedding (padding_idx=pad_token_id) gives the pad row no gradient from its lookups; megatron's has no
    padding_idx, and moved it by ~1e-3 in one step where HF did not. Against the DTensor engine (HF's modules):
    the pad row, and every weight, as in the layout tests; under TP=2 + SP too (the embedding reduce-scatters)."""
    ckpt = tiny_ckpt("qwen2")
    (ref,) = [w for w in run_distributed(_train_on_pad_tokens, world_size=1, args=(ckpt, None)) if w]
    (got,) = [w for w in run_distributed(_train_on_pad_tokens, world_size=world_size, args=(ckpt, megatron_cfg)) if w]
    row = "model.embed_tokens.weight"
    assert float((got[row][0] - ref[row][0]).abs().max()) <= 1e-6
    rel, absolute = weight_diffs(got, ref)
    assert rel <= 1e-6 and absolute <= 1e-5, (rel, absolute)
