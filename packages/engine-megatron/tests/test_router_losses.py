"""The MoE router's auxiliary losses are reported as `moe/*` metrics of the training step, and equal a float64
computation from the HF model's router logits on the very micro-batches the engine ran."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import dp_indices, global_batch, make_policy

from rl_core.config import LossConfig
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

ROUTER_LOSSES = {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6, 11, 4, 6, 9]  # padded rows: the router sees the pad tokens too


def _train_step(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> dict:
    """One train_batch; its metrics and the (tokens, position_ids) of each micro-batch megatron ran."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {**ROUTER_LOSSES, **megatron_cfg}, train_micro_batch_size=2))
    inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    inner = engine._micro_batches

    def recording(batch, mb_plan):
        mbs = inner(batch, mb_plan)
        inputs.extend((mb.tokens.clone(), mb.position_ids.clone()) for mb in mbs)
        return mbs

    batch = global_batch(0, LENGTHS)
    mine = batch.select(dp_indices(len(batch), engine.dp_rank, engine.dp_size))
    before = engine.compute_logprobs(mine)
    engine._micro_batches = recording
    metrics = engine.train_batch(mine.with_fields(prev_logprobs=before), ClippedPGLoss(LossConfig()))
    return {"metrics": metrics, "inputs": inputs}


def _hf_router_losses(ckpt: str, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Switch load-balancing loss (E / (k N^2) sum_e count_e * sum_tokens p_e) and z-loss (mean logsumexp^2) of
    each layer and micro-batch, in float64 from HF's router logits (its MoE kernels take no float64 model); mean
    over layers, then over micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    num_experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    balancing, z = [], []
    with torch.no_grad():
        for tokens, positions in micro_batches:
            out = model(tokens, position_ids=positions, output_router_logits=True)
            per_layer_balancing, per_layer_z = [], []
            for logits in out.router_logits:  # (N, E) per layer
                logits = logits.double()
                n = logits.shape[0]
                probs = logits.softmax(-1)
                counts = torch.zeros(num_experts, dtype=torch.float64).index_add_(
                    0, logits.topk(top_k, dim=-1).indices.flatten(), torch.ones(n * top_k, dtype=torch.float64))
                per_layer_balancing.append(num_experts / (top_k * n * n) * float((counts * probs.sum(0)).sum()))
                per_layer_z.append(float(logits.logsumexp(-1).square().mean()))
            balancing.append(sum(per_layer_balancing) / len(per_layer_balancing))
            z.append(sum(per_layer_z) / len(per_layer_z))
    return {"moe/load_balancing_loss": sum(balancing) / len(balancing), "moe/z_loss": sum(z) / len(z)}


@pytest.mark.distributed
@pytest.mark.parametrize(("world_size", "megatron_cfg"), [(1, {}), (2, {"expert_model_parallel_size": 2})],
                         ids=["one_rank", "ep2"])
def test_router_losses_are_reported_as_hf_computes_them(tiny_ckpt, world_size: int, megatron_cfg: dict) -> None:
    ckpt = tiny_ckpt("qwen3_moe")
    run = run_distributed(_train_step, world_size=world_size, args=(ckpt, megatron_cfg))
    # megatron averages over DP ranks: the mean of each rank's own micro-batch mean
    per_rank = [_hf_router_losses(ckpt, rank["inputs"]) for rank in run]
    for name in ("moe/load_balancing_loss", "moe/z_loss"):
        expected = sum(r[name] for r in per_rank) / len(per_rank)
        for rank in run:
            assert rank["metrics"][name] == pytest.approx(expected, rel=1e-5), (name, rank["metrics"])
    assert run[0]["metrics"]["num_micro_batches"] == len(run[0]["inputs"]) >= 2


def _dense_metrics(rank: int, world_size: int, ckpt: str) -> list[str]:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt))
    batch = global_batch(0)
    metrics = engine.train_batch(batch.with_fields(prev_logprobs=engine.compute_logprobs(batch)),
                                 ClippedPGLoss(LossConfig()))
    return sorted(metrics)


@pytest.mark.distributed
def test_no_router_loss_metrics_without_router_losses(tiny_ckpt) -> None:
    """The default MoE mapping routes no auxiliary loss (coefficients 0): no moe/* metric, as for a dense model."""
    [names] = run_distributed(_dense_metrics, world_size=1, args=(tiny_ckpt("qwen3_moe"),))
    assert names and not [n for n in names if n.startswith("moe/")], names
