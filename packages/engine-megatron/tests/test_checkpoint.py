"""Save, load, continue == uninterrupted, bit for bit; and rl-core's TrainingEngine contract."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_testutil import LOSS, VOCAB, dp_indices, global_batch, make_policy
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import check_training_engine
from rl_core.testing.distributed import run_distributed

# warmup + cosine so that a restored scheduler matters; several steps so that Adam's state matters
SCHEDULE = {"scheduler": {"warmup_steps": 2, "decay": "cosine", "total_steps": 6, "min_lr_ratio": 0.1}}


def _train(engine, batch, steps: int) -> list[dict]:
    loss = ClippedPGLoss(LOSS)
    out = []
    for _ in range(steps):
        prev = [lp.clone() for lp in engine.compute_logprobs(batch)]
        out.append(engine.train_batch(batch.with_fields(prev_logprobs=prev), loss))
    return out


def _resume(rank: int, world_size: int, ckpt: str, megatron_cfg: dict, save_dir: str) -> dict:
    from engine_megatron.engine import MegatronEngine

    def fresh() -> MegatronEngine:
        return MegatronEngine(make_policy(ckpt, megatron_cfg, **SCHEDULE))

    engine = fresh()
    batch = global_batch(3)
    batch = batch.select(dp_indices(len(batch), engine.dp_rank, engine.dp_size))
    _train(engine, batch, 2)
    engine.save_checkpoint(save_dir)
    straight = _train(engine, batch, 2)
    straight_lp = engine.compute_logprobs(batch)
    straight_w = dict(engine.export_hf_weights())

    engine = fresh()  # a new engine: weights from the HF checkpoint, optimizer empty, scheduler at 0
    engine.load_checkpoint(save_dir)
    resumed = _train(engine, batch, 2)
    resumed_lp = engine.compute_logprobs(batch)
    resumed_w = dict(engine.export_hf_weights())
    return {
        "metrics": (straight, resumed),
        "logprobs_equal": all(torch.equal(a, b) for a, b in zip(straight_lp, resumed_lp)),
        "weights_equal": sorted(straight_w) == sorted(resumed_w)
        and all(torch.equal(straight_w[k], resumed_w[k]) for k in straight_w),
        "files": sorted(p.name for p in Path(save_dir).parent.iterdir()),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "megatron_cfg"), [
    (1, {}),
    (2, {"tensor_model_parallel_size": 2}),
    (2, {}),  # DP=2: the distributed optimizer's state is sharded over DP
])
def test_save_load_continue_is_bitwise(tiny_ckpt, tmp_path: Path, world: int, megatron_cfg: dict) -> None:
    results = run_distributed(_resume, world_size=world, args=(tiny_ckpt("qwen2"), megatron_cfg,
                                                               str(tmp_path / "ckpt" / "step2")))
    for res in results:
        straight, resumed = res["metrics"]
        assert straight == resumed, (straight, resumed)  # loss, grad norm, lr (scheduler), metrics: exact
        assert res["logprobs_equal"] and res["weights_equal"]
        assert res["files"] == ["step2"], "a temporary checkpoint directory was left behind"
    assert straight[0]["lr"] != straight[1]["lr"], "the schedule should still be warming up / decaying"


def _contract(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> bool:
    from engine_megatron.engine import MegatronEngine

    check_training_engine(lambda: MegatronEngine(make_policy(ckpt, megatron_cfg)), VOCAB)
    return True


@pytest.mark.distributed
@pytest.mark.parametrize(("world", "megatron_cfg"), [(1, {}), (2, {"pipeline_model_parallel_size": 2})])
def test_training_engine_contract(tiny_ckpt, world: int, megatron_cfg: dict) -> None:
    assert run_distributed(_contract, world_size=world, args=(tiny_ckpt("llama"), megatron_cfg)) == [True] * world


def _registry(rank: int, world_size: int, ckpt: str) -> str:
    from rl_core.registry import create_engine

    return type(create_engine(make_policy(ckpt))).__name__


@pytest.mark.distributed
def test_selected_by_megatron_cfg_enabled(tiny_ckpt) -> None:
    assert run_distributed(_registry, world_size=1, args=(tiny_ckpt("qwen2"),)) == ["MegatronEngine"]
