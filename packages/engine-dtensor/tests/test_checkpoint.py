"""Checkpoints resume bit for bit; exported weights are the model (HF logits identical); contract."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import VOCAB, grpo_batch, make_policy, max_abs_diff
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import check_training_engine
from rl_core.testing.distributed import run_distributed


def _train(engine: DTensorEngine, shard, steps: int) -> list[float]:
    return [engine.train_batch(shard, ClippedPGLoss())["loss"] for _ in range(steps)]


def _resume(rank: int, world: int, path: str, batch, ckpt_dir: str) -> tuple:
    policy = make_policy(
        path, train_micro_batch_size=2, scheduler={"warmup_steps": 2, "decay": "cosine", "total_steps": 6}
    )
    shard = batch.select(list(range(rank, len(batch), world)))
    straight = DTensorEngine(policy)
    losses = _train(straight, shard, 4)
    lrs_straight = straight.scheduler.get_last_lr()
    params = dict(straight.export_hf_weights())

    first = DTensorEngine(policy)
    _train(first, shard, 2)
    _seed(100 + rank)  # each rank's own RNG stream, as a trainer seeds them
    first.save_checkpoint(ckpt_dir)
    first.save_checkpoint(ckpt_dir)  # overwriting an existing checkpoint is atomic too
    after_save = _draw()
    _train(first, shard, 1)  # state the loader must NOT see
    _seed(1234 + rank)  # nor the RNG state of the process that loads it
    resumed = DTensorEngine(policy)
    resumed.load_checkpoint(ckpt_dir)
    after_load = _draw()  # RNG restored: the draw after load equals the draw after save
    resumed_losses = _train(resumed, shard, 2)
    return (
        losses,
        resumed_losses,
        lrs_straight,
        resumed.scheduler.get_last_lr(),
        params,
        dict(resumed.export_hf_weights()),
        (after_save, after_load, _draw()),
    )


def _seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _draw() -> tuple[list[float], float]:
    """A draw from torch's and Python's RNG (CPU: the states a checkpoint holds on this machine)."""
    return torch.rand(4).tolist(), random.random()


@pytest.mark.distributed
def test_save_load_continue_is_bit_exact(ckpt, tmp_path) -> None:
    batch = grpo_batch(ckpt("qwen2"))
    results = run_distributed(_resume, 2, args=(ckpt("qwen2"), batch, str(tmp_path / "step2")))
    losses, resumed_losses, lrs, resumed_lrs, params, resumed_params, _ = results[0]
    assert resumed_losses == losses[2:]  # floats compared exactly
    draws = [rank_result[-1] for rank_result in results]
    for after_save, after_load, later in draws:  # each rank gets its own RNG state back
        assert after_load == after_save and later != after_save
    assert draws[0][0] != draws[1][0]  # the ranks' streams differ, so a rank given another's state shows
    assert resumed_lrs == lrs
    assert params.keys() == resumed_params.keys()
    assert all(torch.equal(params[k], resumed_params[k]) for k in params)
    assert sorted(os.listdir(tmp_path)) == ["step2"]  # no .tmp / .old left behind


def _export(rank: int, world: int, path: str, batch, out_dir: str) -> tuple:
    engine = DTensorEngine(
        make_policy(path, dtensor_cfg={"tensor_parallel_size": world}, logprob_batch_size=1)
    )
    engine.train_batch(batch, ClippedPGLoss())  # exported weights must be the trained ones
    exported = {}
    for name, tensor in engine.export_hf_weights():
        assert not hasattr(tensor, "placements") and name not in exported
        exported[name] = tensor.clone()
    engine.save_hf(out_dir)
    return exported, engine.compute_logprobs(batch)


@pytest.mark.distributed
def test_exported_weights_give_identical_hf_logits(ckpt, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    path, out = ckpt("llama"), str(tmp_path / "hf")
    batch = grpo_batch(path, lengths=[6, 11, 4])
    exported, engine_logprobs = run_distributed(_export, 2, args=(path, batch, out))[0]  # TP=2 shards
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert exported.keys() == dict(fresh.named_parameters()).keys()
    assert max_abs_diff(exported, dict(fresh.named_parameters())) > 1e-4  # really the trained weights
    fresh.load_state_dict(exported)
    with torch.no_grad():
        for ids, lp in zip(batch.input_ids, engine_logprobs):
            logits = loaded(input_ids=ids[None]).logits
            assert torch.equal(logits, fresh(input_ids=ids[None]).logits)  # save_hf == export, bit for bit
            ref = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
            assert (lp[1:] - ref).abs().max() <= 2e-6  # TP engine vs HF: layout rounding only
    assert (tmp_path / "hf" / "tokenizer.json").exists()


def _contract(rank: int, world: int, path: str, overrides: dict, shared_dir: str) -> None:
    warmup = {"warmup_steps": 4, "decay": "constant"}  # the lr moves every step: a restored schedule shows
    policy = make_policy(path, scheduler=warmup, **overrides)
    check_training_engine(lambda: DTensorEngine(policy), VOCAB, checkpoint_dir=shared_dir,
                          lr_at=lambda k: policy.optimizer.kwargs["lr"] * policy.scheduler.lr_factor(k))


@pytest.mark.parametrize(
    ("world", "overrides"),
    [
        (
            1,
            {
                "sequence_packing": {"enabled": True, "train_mb_tokens": 24},
                "dtensor_cfg": {"activation_checkpointing": True},  # wrapped layers: names and DCP keys
            },
        ),
        pytest.param(
            2,
            {"dtensor_cfg": {"tensor_parallel_size": 2, "sequence_parallel": True}},
            marks=pytest.mark.distributed,
        ),
        pytest.param(2, {"train_micro_batch_size": 1}, marks=pytest.mark.distributed),
    ],
    ids=["1rank-packed-ac", "tp2-sp", "dp2"],
)
def test_training_engine_contract(ckpt, tmp_path, world: int, overrides: dict) -> None:
    run_distributed(_contract, world, args=(ckpt("qwen3"), overrides, str(tmp_path)))


class _ConstantLREngine(DTensorEngine):
    """A plug-in that forgets the schedule: its lr stays the optimizer's initial one."""

    def optimizer_step(self) -> dict[str, float]:
        self.scheduler.step = lambda: None
        return super().optimizer_step()


class _SilentStepEngine(DTensorEngine):
    """A plug-in whose optimizer_step steps but reports nothing (the trainer would log no grad norm and no lr)."""

    def optimizer_step(self) -> dict[str, float]:
        super().optimizer_step()
        return {}

    def train_batch(self, batch, loss_fn) -> dict[str, float]:  # its own train_batch still reports both
        self.zero_grad()
        result = self.forward_backward(batch, loss_fn)
        return {"loss": result.loss, **DTensorEngine.optimizer_step(self)}


def _contract_failure(rank: int, world: int, path: str, engine_cls: type, shared_dir: str) -> str:
    policy = make_policy(path, scheduler={"warmup_steps": 4, "decay": "constant"})
    with pytest.raises(AssertionError) as failure:
        check_training_engine(lambda: engine_cls(policy), VOCAB, checkpoint_dir=shared_dir,
                              lr_at=lambda k: policy.optimizer.kwargs["lr"] * policy.scheduler.lr_factor(k))
    return str(failure.value)


@pytest.mark.parametrize(("engine_cls", "message"), [(_ConstantLREngine, "!= the configured"),
                                                     (_SilentStepEngine, "optimizer_step metrics lack")])
def test_contract_refuses_an_engine_that_ignores_the_schedule_or_reports_no_step(ckpt, tmp_path, engine_cls,
                                                                                  message) -> None:
    # in a rank process, as every engine test: an engine built here would leave this process a process group
    failure = run_distributed(_contract_failure, 1, args=(ckpt("qwen3"), engine_cls, str(tmp_path)))[0]
    assert message in failure, failure


def _moe_save(rank: int, world: int, path: str, batch, out_dir: str) -> tuple:
    engine = DTensorEngine(make_policy(path, logprob_batch_size=1))
    engine.train_batch(batch, ClippedPGLoss())
    names = [name for name, _ in engine.export_hf_weights()]
    engine.save_hf(out_dir)
    return names, engine.compute_logprobs(batch)


def test_moe_export_uses_checkpoint_names(ckpt, tmp_path) -> None:
    """transformers fuses MoE experts in memory; export and save_hf give the per-expert HF names back."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path, out = ckpt("qwen3_moe"), str(tmp_path / "hf")
    batch = grpo_batch(path, lengths=[6, 11])
    names, engine_logprobs = run_distributed(_moe_save, 1, args=(path, batch, out))[0]
    with safe_open(f"{path}/model.safetensors", "pt") as original:
        assert sorted(names) == sorted(original.keys())
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        for ids, lp in zip(batch.input_ids, engine_logprobs):
            ref = torch.log_softmax(loaded(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[
                :, 0
            ]
            assert (lp[1:] - ref).abs().max() <= 1e-6


def _save_or_load(rank: int, world: int, path: str, batch, ckpt_dir: str, save: bool) -> dict | None:
    engine = DTensorEngine(make_policy(path))
    if save:
        engine.train_batch(batch.select(list(range(rank, len(batch), world))), ClippedPGLoss())
        engine.save_checkpoint(ckpt_dir)
    else:
        engine.load_checkpoint(ckpt_dir)
    weights = dict(engine.export_hf_weights())
    return weights if rank == 0 else None


@pytest.mark.distributed
def test_checkpoint_reshards_from_two_ranks_to_one(ckpt, tmp_path) -> None:
    path, ckpt_dir = ckpt("llama"), str(tmp_path / "ckpt")
    batch = grpo_batch(path, lengths=[5, 9, 7, 12])
    saved = run_distributed(_save_or_load, 2, args=(path, batch, ckpt_dir, True))[0]
    loaded = run_distributed(_save_or_load, 1, args=(path, batch, ckpt_dir, False))[0]
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


class _MarkerPayload:
    """A pickle that, when unpickled, creates a file: what a hostile extra_rank0.pt would hold."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _load_tampered(rank: int, world: int, path: str, ckpt_dir: str, marker: str) -> str:
    from rl_core.checkpoint_io import CheckpointError, write_manifest

    engine = DTensorEngine(make_policy(path))
    engine.save_checkpoint(ckpt_dir)
    torch.save({"scheduler": {}, "rng": _MarkerPayload(marker)}, f"{ckpt_dir}/extra_rank0.pt")
    with pytest.raises(CheckpointError, match="extra_rank0.pt"):  # the manifest catches the edit first
        engine.load_checkpoint(ckpt_dir)
    write_manifest(ckpt_dir)  # an attacker who also rewrites the manifest: weights_only still refuses
    with pytest.raises(CheckpointError, match="extra_rank0.pt cannot be loaded safely") as info:
        engine.load_checkpoint(ckpt_dir)
    return str(info.value)


def test_crafted_pickle_in_extra_state_never_runs(ckpt, tmp_path) -> None:
    marker = tmp_path / "payload_ran"
    message = run_distributed(_load_tampered, 1, args=(ckpt("llama"), str(tmp_path / "ckpt"), str(marker)))[0]
    assert not marker.exists(), message



def _resume_with_changed_optimizer(rank: int, world: int, path: str, ckpt_dir: str) -> bool:
    """1 step, save; the running engine changes lr and weight decay in place, a fresh one with them in its
    config loads the checkpoint; both train 2 more steps. Returns whether their weights are equal."""
    batch = grpo_batch(path)
    first = DTensorEngine(make_policy(path, scheduler={"warmup_steps": 3}))
    _train(first, batch, 1)
    first.save_checkpoint(ckpt_dir)

    changed = make_policy(path, scheduler={"warmup_steps": 3})
    changed.optimizer.kwargs.update(lr=1e-2, weight_decay=0.1)
    resumed = DTensorEngine(changed)
    resumed.load_checkpoint(ckpt_dir)
    for group in first.optimizer.param_groups:  # the reference: the same change made in the running engine
        group.update(initial_lr=1e-2, weight_decay=0.1)
    first.scheduler.base_lrs = [1e-2]
    first.scheduler.last_epoch -= 1
    first.scheduler.step()  # lr = 1e-2 * warmup factor of the step it is at
    assert resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr() == [1e-2 * (2 / 3)]
    _train(first, batch, 2)
    _train(resumed, batch, 2)
    want, got = dict(first.export_hf_weights()), dict(resumed.export_hf_weights())
    return all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.distributed
def test_resume_follows_the_configured_optimizer_settings(ckpt, tmp_path) -> None:
    """A resumed run with another lr / weight decay trains with them (before: the checkpoint's, silently),
    as a run that changes them in place after the same step does."""
    assert run_distributed(_resume_with_changed_optimizer, 1, args=(ckpt("qwen2"), str(tmp_path / "step1")))[0]


def _load_damaged_and_foreign(rank: int, world: int, path: str, root: str) -> tuple[str, str]:
    engine = DTensorEngine(make_policy(path))
    engine.save_checkpoint(f"{root}/step1")
    os.unlink(f"{root}/step1/.metadata")
    os.mkdir(f"{root}/hf")
    messages = []
    for directory in (f"{root}/step1", f"{root}/hf"):  # a damaged checkpoint; a directory that is none
        try:
            engine.load_checkpoint(directory)
        except ValueError as exc:  # CheckpointError is one
            messages.append(str(exc))
    return tuple(messages)


@pytest.mark.distributed
def test_a_deleted_metadata_file_is_reported_as_missing(ckpt, tmp_path) -> None:
    """Before: "not a DTensor engine checkpoint" for a damaged one; a directory that is none still says so."""
    damaged, foreign = run_distributed(_load_damaged_and_foreign, 1, args=(ckpt("qwen2"), str(tmp_path)))[0]
    assert re.search(r"step1/\.metadata is missing \(listed in .*MANIFEST.json\)", damaged), damaged
    assert "is not a DTensor engine checkpoint" in foreign
