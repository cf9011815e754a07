"""Helpers shared by the engine-megatron tests (a module: conftest is not importable in importlib mode).

`engine_run` is what every multi-rank test runs inside `run_distributed`: build a MegatronEngine from a
tiny HF checkpoint, compute logprobs of this rank's DP shard of one fixed global batch, train, export.
Results carry the global sequence indices so that runs with different layouts can be compared.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from rl_core.batch import TokenBatch
from rl_core.config import LossConfig, PolicyConfig, parse_config
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.truncation import truncated_log_softmax

VOCAB = 100  # tiny checkpoints with vocab 100: megatron pads to 128 * TP, so padding is exercised
LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6]
LOSS = LossConfig(eps_low=0.2, eps_high=0.28, agg="token-mean")

# AdamW eps 1e-6 (torch's default is 1e-8): Adam's first step is lr * g / (|g| + eps), which turns a
# gradient element at the float-noise floor (|g| ~ 1e-9, where two engines or layouts sum in a different
# order) into an lr-sized update of random sign. eps = 1e-6 keeps such elements ~1e-6 * lr apart instead
# of ~0.1 * lr, so the weight comparison measures the engines rather than Adam's noise amplification.
POLICY = {
    "precision": "float32",
    "train_micro_batch_size": 2,
    "logprob_batch_size": 3,
    "max_grad_norm": 1.0,
    "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6}},
    "scheduler": {"warmup_steps": 0, "decay": "constant"},
}


def make_policy(ckpt: str, megatron_cfg: dict[str, Any] | None = None, **overrides: Any) -> PolicyConfig:
    raw = copy.deepcopy(POLICY)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key].update(value)
        else:
            raw[key] = value
    raw.update(model_name=ckpt, megatron_cfg={"enabled": True, **(megatron_cfg or {})})
    return parse_config(PolicyConfig, raw, "policy")


def global_batch(seed: int = 0, lengths: list[int] | None = None) -> TokenBatch:
    return random_token_batch(VOCAB, lengths or LENGTHS, seed=seed)


def dp_indices(n: int, dp_rank: int, dp_size: int, uneven: bool = False) -> list[int]:
    """Interleaved DP shards; `uneven`: the last DP rank gets one sequence, the others share the rest
    (it then runs zero-weight dummy micro-batches to match the other ranks' count)."""
    if not uneven or dp_size == 1:
        return list(range(dp_rank, n, dp_size))
    if dp_rank == dp_size - 1:
        return [n - 1]
    return list(range(dp_rank, n - 1, dp_size - 1))


def engine_layout(engine: Any) -> dict[str, Any]:
    """What this rank really runs: megatron's process-grid sizes (parallel_state, not the config the test
    asked for), the engine's packing setting, and the parameter elements this rank holds (fewer than
    the 1-rank model's exactly when TP/PP/EP shard it)."""
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "packing": engine.settings.packing,
            "numel": sum(p.numel() for p in engine.model.parameters())}


def record_micro_batches(engine: Any) -> list[list[tuple[int, int, int, bool]]]:
    """Wrap `engine._micro_batches`: per call, (real sequences, rows, columns, packed) of every micro-batch
    handed to megatron's schedule (packed: it carries THD PackedSeqParams; 0 sequences: a dummy)."""
    calls: list[list[tuple[int, int, int, bool]]] = []
    inner = engine._micro_batches

    def recording(batch: TokenBatch, mb_plan: Any) -> list:
        mbs = inner(batch, mb_plan)
        calls.append([(len(mb.batch) if mb.weight else 0, *mb.shape, mb.packed_seq_params is not None)
                      for mb in mbs])
        return mbs

    engine._micro_batches = recording
    return calls


def engine_run(rank: int, world_size: int, ckpt: str, megatron_cfg: dict[str, Any], policy_kw: dict[str, Any],
               steps: int = 1, export: bool = True, seed: int = 0, uneven: bool = False,
               agg: str = LOSS.agg) -> dict[str, Any]:
    """Build, logprobs, `steps` x train_batch, logprobs again, export; per-rank results by global index,
    plus the layout that really ran (`engine_layout`, and the micro-batches of each train step)."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, megatron_cfg, **policy_kw))
    calls = record_micro_batches(engine)
    batch = global_batch(seed)
    indices = dp_indices(len(batch), engine.dp_rank, engine.dp_size, uneven)
    mine = batch.select(indices)
    before = engine.compute_logprobs(mine)
    mine = mine.with_fields(prev_logprobs=[lp.clone() for lp in before])
    loss = ClippedPGLoss(dataclasses.replace(LOSS, agg=agg))
    metrics, train_mbs = [], []
    for _ in range(steps):
        metrics.append(engine.train_batch(mine, loss))
        train_mbs.append(calls.pop())
    after = engine.compute_logprobs(mine)
    weights = None
    if export:
        exported = {name: tensor.clone() for name, tensor in engine.export_hf_weights()}
        weights = exported if rank == 0 else sorted(exported)
    return {"indices": indices, "before": before, "after": after, "metrics": metrics, "weights": weights,
            "layout": {**engine_layout(engine), "train_micro_batches": train_mbs}}


def dtensor_run(rank: int, world_size: int, ckpt: str, dtensor_cfg: dict[str, Any], steps: int = 1) -> dict[str, Any]:
    """`engine_run`'s results for the DTensor engine (`policy.dtensor_cfg` = `dtensor_cfg`) on the same policy:
    logprobs, `steps` x train_batch, logprobs again, the exported weights (rank 0)."""
    from engine_dtensor.engine import DTensorEngine

    policy = make_policy(ckpt)
    policy.megatron_cfg = {"enabled": False}
    policy.dtensor_cfg = {"enabled": True, **dtensor_cfg}
    engine = DTensorEngine(policy)
    batch = global_batch(0)
    indices = dp_indices(len(batch), engine.dp_rank, engine.dp_size)
    mine = batch.select(indices)
    before = engine.compute_logprobs(mine)
    mine = mine.with_fields(prev_logprobs=[lp.clone() for lp in before])
    metrics = [engine.train_batch(mine, ClippedPGLoss(LOSS)) for _ in range(steps)]
    after = engine.compute_logprobs(mine)
    weights = {name: tensor.clone() for name, tensor in engine.export_hf_weights()}
    return {"indices": indices, "before": before, "after": after, "metrics": metrics,
            "weights": weights if rank == 0 else None}


def expected_layout(world_size: int, megatron_cfg: dict[str, Any], policy_kw: dict[str, Any]) -> dict[str, Any]:
    """The process grid and packing a run of `megatron_cfg` / `policy_kw` on `world_size` ranks must have."""
    tp = megatron_cfg.get("tensor_model_parallel_size", 1)
    pp = megatron_cfg.get("pipeline_model_parallel_size", 1)
    cp = megatron_cfg.get("context_parallel_size", 1)
    return {"tp": tp, "pp": pp, "cp": cp, "ep": megatron_cfg.get("expert_model_parallel_size", 1),
            "dp": world_size // (tp * pp * cp),
            "packing": bool(policy_kw.get("sequence_packing", {}).get("enabled", False))}


def assert_layout(run: list[dict[str, Any]], world_size: int, megatron_cfg: dict[str, Any],
                  policy_kw: dict[str, Any], ref: list[dict[str, Any]] | None = None) -> None:
    """Each rank of `run` (engine_run results) ran the layout its config asks for, not a silent fallback
    (at world size 2 a dropped TP/PP becomes DP=2, dropped packing becomes padded rows: same numbers).

    Per rank and train step: the grid sizes from parallel_state, settings.packing, every micro-batch
    packed (one row with PackedSeqParams) or padded accordingly, each within its budget (train_mb_tokens,
    or train_micro_batch_size rows), every local sequence in exactly one micro-batch, the same count on
    every DP rank, = the step's num_micro_batches; for padded micro-batches of at most
    train_micro_batch_size sequences that count is ceil(largest DP shard / train_micro_batch_size).
    With `ref` (the 1-rank run): a rank holds fewer parameter elements exactly when TP, PP or EP > 1.
    """
    want = expected_layout(world_size, megatron_cfg, policy_kw)
    policy = {**POLICY, **policy_kw}
    packing, dynamic = policy.get("sequence_packing", {}), policy.get("dynamic_batching", {})
    budget = packing.get("train_mb_tokens") if want["packing"] else (
        dynamic.get("train_mb_tokens") if dynamic.get("enabled") else None)
    mb_size = policy["train_micro_batch_size"]
    largest = max(len(res["indices"]) for res in run)
    assert len(run) == world_size
    for rank, res in enumerate(run):
        layout = res["layout"]
        got = {k: layout[k] for k in want}
        assert got == want, f"rank {rank} ran {got}, its config asks for {want}"
        for step, mbs in enumerate(layout["train_micro_batches"]):
            where = f"rank {rank} step {step}: {mbs}"
            assert res["metrics"][step]["num_micro_batches"] == len(mbs), where
            assert len(mbs) == len(run[0]["layout"]["train_micro_batches"][step]), where  # same count per rank
            assert sum(n for n, *_ in mbs) == len(res["indices"]), where
            assert all(packed == want["packing"] for *_, packed in mbs), where
            if want["packing"]:
                assert all(rows == 1 and cols <= budget for _, rows, cols, _ in mbs), where
            elif budget is not None:
                assert all(rows * cols <= budget for _, rows, cols, _ in mbs), where
            else:
                assert all(rows <= mb_size for _, rows, _, _ in mbs), where
                assert len(mbs) == -(-largest // mb_size), where
        if ref is not None:
            sharded = want["tp"] * want["pp"] * want["ep"] > 1
            ref_numel = ref[0]["layout"]["numel"]
            assert (layout["numel"] < ref_numel) if sharded else (layout["numel"] == ref_numel), (
                rank, layout["numel"], ref_numel)


def by_index(results: list[dict[str, Any]], key: str) -> dict[int, torch.Tensor]:
    out = {}
    for res in results:
        out.update(zip(res["indices"], res[key]))
    return out


def max_abs_diff(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b|| / ||b|| (float64)."""
    assert sorted(a) == sorted(b), f"different keys: {sorted(set(a) ^ set(b))[:5]}"
    return max(float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30)) for k in a)


def hf_target_logprobs(ckpt: str, batch: TokenBatch, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> list[torch.Tensor]:
    """Independent reference: the HF model, one sequence at a time, fp64 log-softmax of fp32 logits (over the
    top-k / top-p kept tokens and the target, rl_core.testing.truncation, when those are set)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in batch.input_ids:
            logits = model(ids[None]).logits[0].double() / temperature  # (L, V)
            logp = truncated_log_softmax(logits[:-1], top_k, top_p, targets=ids[1:])
            lp = logp.gather(-1, ids[1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1, dtype=torch.float64), lp]).float())
    return out


def weight_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(||a - b|| / ||b|| over all tensors together, max |a - b|), float64.

    Why not per tensor: a bias whose gradient is analytically zero (the k_proj bias: softmax ignores a
    shift shared by all keys) gets an Adam update made of float noise, ~lr in size with a random sign, in
    every engine and layout. Over the whole model that is ~1e-6 relative; per such tensor it is ~1e-4.
    """
    assert sorted(a) == sorted(b), f"different names: {sorted(set(a) ^ set(b))[:5]}"
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(b[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5, max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


_REFERENCES: dict[tuple, list[dict[str, Any]]] = {}


def reference_run(ckpt: str, policy_kw: dict[str, Any] | None = None, steps: int = 1,
                  agg: str = LOSS.agg) -> list[dict[str, Any]]:
    """The 1-rank (TP=PP=DP=EP=1, padded) run of `ckpt`, computed once per session."""
    from rl_core.testing.distributed import run_distributed

    key = (ckpt, repr(sorted((policy_kw or {}).items())), steps, agg)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_distributed(engine_run, world_size=1,
                                           args=(ckpt, {}, policy_kw or {}, steps, True, 0, False, agg))
        assert_layout(_REFERENCES[key], 1, {}, policy_kw or {})
    return _REFERENCES[key]


def assert_same_run(run: list[dict[str, Any]], ref: list[dict[str, Any]], *, logprob_tol: float = 5e-6,
                    weight_rel_tol: float = 1e-6, weight_abs_tol: float = 1e-5) -> dict[str, float]:
    """Logprobs before/after one step, loss, grad norm and exported weights of two runs agree.

    logprob_tol 5e-6: logprobs here are ~ -5, where one float32 ulp is 4.8e-7; a different reduction
    order (TP all-reduce, packed vs padded attention) moves them by a few ulps (measured <= 1.9e-6).
    """
    before = max_abs_diff(by_index(run, "before"), by_index(ref, "before"))
    after = max_abs_diff(by_index(run, "after"), by_index(ref, "after"))
    m, m_ref = run[0]["metrics"][-1], ref[0]["metrics"][-1]
    loss = abs(m["loss"] - m_ref["loss"])
    grad_norm = abs(m["grad_norm"] - m_ref["grad_norm"]) / m_ref["grad_norm"]
    rel, absolute = weight_diffs(run[0]["weights"], ref[0]["weights"])
    diffs = {"logprobs_before": before, "logprobs_after": after, "loss": loss, "grad_norm_rel": grad_norm,
             "weights_rel": rel, "weights_abs": absolute}
    assert before <= logprob_tol and loss <= 1e-6 and grad_norm <= 1e-6, diffs
    assert rel <= weight_rel_tol and absolute <= weight_abs_tol and after <= 2 * logprob_tol, diffs
    assert m["num_micro_batches"] >= 1 and m_ref["lr"] == m["lr"], (m, m_ref)
    return diffs
