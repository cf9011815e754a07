"""The weights-only reference policy on megatron: after the policy trained a step, the reference logprobs equal
a separately loaded HF model's on the initial weights (fp32, 1e-5), the policy is bitwise unchanged by the
reference pass, and the reference costs exactly this rank's parameter bytes (its TP shards): no grads, no
optimizer state, no second set of model-parallel groups."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import LOSS, global_batch, hf_target_logprobs, make_policy

from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed
from rl_core.testing.reference import run_reference_check


def _check(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> dict:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, megatron_cfg))
    batch = global_batch(seed=4)
    mine = list(range(engine.dp_rank, len(batch), engine.dp_size))
    params = list(engine.model.parameters())
    result = run_reference_check(engine, batch.select(mine), ClippedPGLoss(LOSS), params=params,
                                 optimizer_tensors=_optimizer_tensors(engine.optimizer))
    return {**result, "indices": mine}


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in sub.optimizer.param_groups:
            out += group["params"]
        out += [t for state in sub.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "megatron_cfg"), [(1, {}), (2, {"tensor_model_parallel_size": 2})],
                         ids=["1rank", "tp2"])
def test_reference_policy_is_the_initial_model_weights_only(tiny_ckpt, world: int, megatron_cfg: dict) -> None:
    ckpt = tiny_ckpt("qwen2")
    batch = global_batch(seed=4)
    hf = hf_target_logprobs(ckpt, batch)
    for result in run_distributed(_check, world_size=world, args=(ckpt, megatron_cfg)):
        expected = [hf[i] for i in result["indices"]]
        ref_diff = max(float((a - b).abs().max()) for a, b in zip(result["ref"], expected))
        moved = max(float((a - b).abs().max()) for a, b in zip(result["policy_before"], expected))
        assert ref_diff <= 1e-5 and moved > 1e-3, (ref_diff, moved)
        assert all(torch.equal(a, b) for a, b in zip(result["policy_before"], result["policy_after"]))
        assert result["reference_bytes"] == result["param_bytes"] > 0
        assert not result["reference_has_grad"] and not result["reference_in_optimizer"]
