"""Save, load, continue == uninterrupted, bit for bit; and rl-core's TrainingEngine contract."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from megatron_testutil import (
    LOSS,
    VOCAB,
    dp_indices,
    engine_layout,
    expected_layout,
    global_batch,
    make_policy,
)

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
    """2 steps, save, 2 more steps; then a fresh engine loads and repeats the last 2 steps."""
    from engine_megatron.engine import MegatronEngine

    def fresh() -> MegatronEngine:
        return MegatronEngine(make_policy(ckpt, megatron_cfg, **SCHEDULE))

    engine = fresh()
    layouts = [engine_layout(engine)]
    batch = global_batch(3)
    batch = batch.select(dp_indices(len(batch), engine.dp_rank, engine.dp_size))
    _train(engine, batch, 2)
    engine.save_checkpoint(save_dir)
    straight = _train(engine, batch, 2)
    straight_lp = engine.compute_logprobs(batch)
    straight_w = dict(engine.export_hf_weights())

    engine = fresh()  # a new engine: weights from the HF checkpoint, optimizer empty, scheduler at 0
    layouts.append(engine_layout(engine))
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
        "layouts": layouts,
        "num_sequences": len(batch),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "world", "megatron_cfg"), [
    ("qwen2", 1, {}),
    ("qwen2", 2, {"tensor_model_parallel_size": 2}),
    ("qwen2", 2, {}),  # DP=2: the distributed optimizer's state is sharded over DP
    ("qwen2", 2, {"pipeline_model_parallel_size": 2}),
    ("qwen3_moe", 2, {"expert_model_parallel_size": 2}),
    # LoRA: the adapters (A replicated / B sharded over TP and the reverse) and their optimizer state, base frozen
    ("qwen2", 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                  "lora_cfg": {"enabled": True, "dim": 4, "alpha": 8.0}}),
    ("qwen2", 2, {"pipeline_model_parallel_size": 2, "lora_cfg": {"enabled": True, "dim": 4, "alpha": 8.0}}),
], ids=["1rank", "tp2", "dp2", "pp2", "moe_ep2", "lora_tp2_sp", "lora_pp2"])
def test_save_load_continue_is_bitwise(tiny_ckpt, tmp_path: Path, arch: str, world: int, megatron_cfg: dict) -> None:
    results = run_distributed(_resume, world_size=world, args=(tiny_ckpt(arch), megatron_cfg,
                                                               str(tmp_path / "ckpt" / "step2")))
    want = expected_layout(world, megatron_cfg, {})  # not a silent DP=2 in place of TP/PP=2
    for res in results:
        straight, resumed = res["metrics"]
        assert [{k: layout[k] for k in want} for layout in res["layouts"]] == [want, want], res["layouts"]
        # 8 sequences over DP ranks, in padded micro-batches of train_micro_batch_size = 2
        assert res["num_sequences"] == 8 // want["dp"] and straight[0]["num_micro_batches"] == 4 // want["dp"]
        assert straight == resumed, (straight, resumed)  # loss, grad norm, lr (scheduler), metrics: exact
        assert res["logprobs_equal"] and res["weights_equal"]
        assert res["files"] == ["step2"], "a temporary checkpoint directory was left behind"
    assert straight[0]["lr"] != straight[1]["lr"], "the schedule should still be warming up / decaying"


def _contract(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> bool:
    from engine_megatron.engine import MegatronEngine

    warmup = {"warmup_steps": 4, "decay": "constant"}  # the lr moves every step: a restored schedule shows
    policy = make_policy(ckpt, megatron_cfg, scheduler=warmup)
    check_training_engine(lambda: MegatronEngine(policy), VOCAB,
                          lr_at=lambda k: policy.optimizer.kwargs["lr"] * policy.scheduler.lr_factor(k))
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


def _save_at_dp2(rank: int, world_size: int, ckpt: str, save_dir: str, megatron_cfg: dict | None = None) -> dict:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, megatron_cfg or {}, **SCHEDULE))
    indices = dp_indices(8, engine.dp_rank, engine.dp_size)
    batch = global_batch(3).select(indices)
    _train(engine, batch, 2)
    engine.save_checkpoint(save_dir)
    metrics = _train(engine, batch, 1)
    return {"metrics": metrics, "indices": indices, "after": engine.compute_logprobs(batch)}


def _load_at_dp1(rank: int, world_size: int, ckpt: str, save_dir: str) -> dict:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {}, **SCHEDULE))
    engine.load_checkpoint(save_dir)
    batch = global_batch(3)
    metrics = _train(engine, batch, 1)
    return {"metrics": metrics, "indices": list(range(8)), "after": engine.compute_logprobs(batch)}


@pytest.mark.distributed
def test_checkpoint_reshards_from_dp2_to_dp1(tiny_ckpt, tmp_path: Path) -> None:
    """The distributed optimizer's state is saved fully reshardable: DP=2 -> DP=1 continues the same run
    (equal up to the DP layout's float rounding, as in test_layouts; a wrong Adam state would differ ~lr)."""
    from megatron_testutil import by_index, max_abs_diff

    ckpt, save_dir = tiny_ckpt("qwen2"), str(tmp_path / "dp2")
    dp2 = run_distributed(_save_at_dp2, world_size=2, args=(ckpt, save_dir))
    dp1 = run_distributed(_load_at_dp1, world_size=1, args=(ckpt, save_dir))
    m2, m1 = dp2[0]["metrics"][0], dp1[0]["metrics"][0]
    assert m1["lr"] == m2["lr"] and abs(m1["loss"] - m2["loss"]) <= 1e-6, (m1, m2)
    assert abs(m1["grad_norm"] / m2["grad_norm"] - 1) <= 1e-6, (m1, m2)
    assert max_abs_diff(by_index(dp1, "after"), by_index(dp2, "after")) <= 1e-5


def _load_error(rank: int, world_size: int, ckpt: str, save_dir: str) -> str:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {}, **SCHEDULE))
    with pytest.raises(ValueError) as exc:
        engine.load_checkpoint(save_dir)
    return str(exc.value)


@pytest.mark.distributed
def test_a_checkpoint_saved_under_expert_parallel_is_refused_at_ep1_with_the_fix(tiny_ckpt, tmp_path: Path) -> None:
    """Under EP > 1 megatron chains a second optimizer for the experts (state keys `chained_1.`), under EP = 1 one
    holds all: dist_checkpointing cannot load one into the other (a KeyError deep in its load). Refused before
    loading, naming the key and the values that work."""
    ckpt, save_dir = tiny_ckpt("qwen3_moe"), str(tmp_path / "ep2")
    run_distributed(_save_at_dp2, world_size=2, args=(ckpt, save_dir, {"expert_model_parallel_size": 2}))
    message = run_distributed(_load_error, world_size=1, args=(ckpt, save_dir))[0]
    assert re.search(r"saved with expert_model_parallel_size=2 and this engine runs "
                     r"policy\.megatron_cfg\.expert_model_parallel_size=1.*resume with "
                     r"policy\.megatron_cfg\.expert_model_parallel_size > 1", message), message


def _convert_on_two_nodes(rank: int, world_size: int, ckpt: str, root: str) -> tuple[bool, bool]:
    """Each rank plays a node of its own with a node-local conversion cache (its own hostname and cache root)."""
    import socket

    from engine_megatron.model import convert_once

    socket.gethostname = lambda: f"node{rank}"
    target = convert_once(ckpt, f"{root}/node{rank}", tp=1, pp=1, ep=1, dtype="float32")
    return target.is_dir(), (target / "ckpt_convert.json").is_file()


@pytest.mark.distributed
def test_a_node_local_conversion_cache_is_filled_on_every_node(tiny_ckpt, tmp_path: Path) -> None:
    """The HF -> megatron conversion ran on global rank 0 only: with the default cache under ~/.cache on
    each node, the ranks of the other nodes got a path that did not exist there."""
    assert run_distributed(_convert_on_two_nodes, world_size=2, args=(tiny_ckpt("qwen2"), str(tmp_path))) == [
        (True, True), (True, True)]


def test_new_weights_with_old_file_times_are_converted_again(tmp_path: Path) -> None:
    """Weights of another seed copied over the model's with their older mtime (`cp -p`): another cache entry (the
    newest mtime alone kept the old one, and the engine trained the previous weights); an untouched directory
    keeps its entry."""
    import os
    import shutil

    from engine_megatron.model import conversion_cache_dir
    from rl_core.testing.tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "model", "qwen2", seed=1)
    other = save_tiny_checkpoint(tmp_path / "other", "qwen2", seed=2)
    before = conversion_cache_dir(str(model), str(tmp_path), 1, 1, 1, "float32")
    assert conversion_cache_dir(str(model), str(tmp_path), 1, 1, 1, "float32") == before
    weights = model / "model.safetensors"
    old_time = min(p.stat().st_mtime_ns for p in model.iterdir())
    shutil.copyfile(other / "model.safetensors", weights)
    os.utime(weights, ns=(old_time, old_time))
    assert conversion_cache_dir(str(model), str(tmp_path), 1, 1, 1, "float32") != before


CHANGED_OPTIMIZER = {"kwargs": {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}}


def _resume_with_changed_optimizer(rank: int, world_size: int, ckpt: str, save_dir: str) -> dict:
    """1 step, save; the same engine changes its optimizer settings in place, a fresh one with them in its
    config loads the checkpoint; both train 1 more step."""
    import logging

    from engine_megatron.engine import MegatronEngine

    schedule = {"scheduler": {"warmup_steps": 3}}
    batch = global_batch(3)
    engine = MegatronEngine(make_policy(ckpt, {}, **schedule))
    _train(engine, batch, 1)
    engine.save_checkpoint(save_dir)
    resumed = MegatronEngine(make_policy(ckpt, {}, **schedule, optimizer=CHANGED_OPTIMIZER))
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("engine_megatron.checkpoint").addHandler(handler)
    resumed.load_checkpoint(save_dir)

    sched = engine.scheduler  # the reference: the change made in the running engine
    sched.get_lr = lambda group: 1e-2 * resumed.policy.scheduler.lr_factor(sched.num_steps)
    sched.start_wd = sched.end_wd = 0.1
    for group in engine.optimizer.param_groups:
        group.update(betas=(0.8, 0.9), weight_decay=0.1, lr=sched.get_lr(group))
    metrics = [_train(e, batch, 1)[0] for e in (engine, resumed)]
    weights = [dict(e.export_hf_weights()) for e in (engine, resumed)]
    return {"lr": [m["lr"] for m in metrics], "warnings": warnings,
            "weights_equal": all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])}


@pytest.mark.distributed
def test_resume_follows_the_configured_optimizer_settings(tiny_ckpt, tmp_path: Path) -> None:
    """Before: the checkpoint's weight decay and betas applied, silently (the lr followed the config)."""
    result = run_distributed(_resume_with_changed_optimizer, world_size=1,
                             args=(tiny_ckpt("qwen2"), str(tmp_path / "step1")))[0]
    assert result["lr"] == [1e-2 * (2 / 3)] * 2
    assert result["weights_equal"]
    # the log names every change, the lr and weight decay too (they were applied without a word)
    changed = [w for w in result["warnings"] if "was saved with other optimizer settings" in w]
    assert len(changed) == 1 and all(f in changed[0] for f in ("betas (0.9, 0.999) -> (0.8, 0.9)", "max_lr 0.001 -> 0.01",
                                                                "start_wd 0.01 -> 0.1")), result["warnings"]


def _load_without_metadata(rank: int, world_size: int, ckpt: str, save_dir: str) -> tuple[str, str]:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {}))
    engine.save_checkpoint(save_dir)
    (Path(save_dir) / "metadata.json").unlink()
    messages = []
    for path in (save_dir, str(Path(save_dir).parent)):  # a damaged checkpoint; a directory that is none
        try:
            engine.load_checkpoint(path)
        except ValueError as exc:
            messages.append(str(exc))
    return tuple(messages)


@pytest.mark.distributed
def test_a_deleted_metadata_file_is_reported_as_missing(tiny_ckpt, tmp_path: Path) -> None:
    """Before: "not an engine checkpoint (no metadata.json)" for a damaged one."""
    damaged, other = run_distributed(_load_without_metadata, world_size=1,
                                     args=(tiny_ckpt("qwen2"), str(tmp_path / "ckpt" / "step1")))[0]
    assert re.search(r"step1/metadata.json is missing \(listed in .*MANIFEST.json\)", damaged), damaged
    assert "is not an engine checkpoint" in other
