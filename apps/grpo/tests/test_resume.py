"""Resume safety (issue 17): damaged checkpoints fall back to the newest intact one, a run directory is
never silently reset, config changes are refused, metrics and TensorBoard are trimmed, keep-top-k scores
each checkpoint with its own validation."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo_app.loop as loop
from grpo_app.build import RunInputs
from grpo_app.checkpoint import CheckpointManager, ResumePoint, check_identity, run_identity
from grpo_app.config import load_config
from grpo_app.metrics_sink import MetricsSink, read_jsonl
from grpo_app.prompts import PromptSource
from rl_core.checkpoint_io import CheckpointError, verify_manifest, write_manifest
from rollout.datasets import PromptExample


def fake_engine_save(path: str) -> None:
    """The files a one-rank DTensor engine checkpoint holds, with the engine's own manifest."""
    policy = Path(path)
    policy.mkdir(parents=True)
    (policy / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (policy / ".metadata").write_bytes(b"dcp-metadata" * 10)
    torch.save({"scheduler": {"last_epoch": 1}, "rng": {"torch": torch.get_rng_state()}}, policy / "extra_rank0.pt")
    write_manifest(policy)


def save_two(root: Path) -> CheckpointManager:
    manager = CheckpointManager(root, keep_top_k=5, metric="m", higher_is_better=True)
    for step in (1, 2):
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": None})
    return manager


def delete(file: Path) -> None:
    file.unlink()


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def corrupt_json(file: Path) -> None:
    file.write_text(file.read_text()[:-3] + "}}")  # same kind of damage a torn write leaves


POLICY_FILES = ("policy/__0_0.distcp", "policy/.metadata", "policy/extra_rank0.pt")
# what the driver finds; a changed byte in policy/ is the engine's to find as it loads (next tests)
DAMAGES = [(rel, damage) for rel in POLICY_FILES for damage in (delete, truncate)]
DAMAGES += [("trainer_state.json", damage) for damage in (delete, truncate, flip_byte, corrupt_json)]
DAMAGES += [("MANIFEST.json", delete), ("policy/MANIFEST.json", delete), ("policy/MANIFEST.json", flip_byte)]


@pytest.mark.parametrize(("rel", "damage"), DAMAGES, ids=[f"{d.__name__}-{r}" for r, d in DAMAGES])
def test_damaged_latest_checkpoint_falls_back_to_newest_intact(tmp_path, caplog, rel, damage):
    manager = save_two(tmp_path)
    damage(tmp_path / "step_2" / rel)
    with caplog.at_level(logging.WARNING):
        point = manager.newest_intact()
    assert point.path == tmp_path / "step_1" and point.step == 1
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "step_2" in warning and Path(rel).name in warning


@pytest.mark.parametrize("rel", POLICY_FILES)
def test_a_changed_byte_in_the_engine_files_is_left_to_the_engine_then_skipped(tmp_path, caplog, rel):
    """The driver checks the engine's files for presence and size only (the engine hashes them as it loads them,
    on all its ranks, so they are not hashed twice); what the engine then finds passes that checkpoint over."""
    manager = save_two(tmp_path)
    flip_byte(tmp_path / "step_2" / rel)
    assert manager.newest_intact().step == 2
    with pytest.raises(CheckpointError, match=Path(rel).name) as found:  # what the engine's load runs first
        verify_manifest(tmp_path / "step_2" / "policy")
    with caplog.at_level(logging.WARNING):
        point = manager.newest_intact({tmp_path / "step_2": str(found.value)})
    assert point.step == 1
    assert "damaged" not in caplog.text  # main warned when the engine found it


def test_a_checkpoint_the_engine_finds_damaged_restarts_the_run_from_the_previous_one(tmp_path, caplog, monkeypatch):
    """Through the CLI entry point: the engine's load (inside run_training) finds step_2 damaged; the run starts
    again from step_1, with the same config and inputs."""
    import grpo_app.build as build
    import grpo_app.main as cli
    from grpo_app.checkpoint import DamagedOnLoad

    monkeypatch.setattr(cli, "preflight", lambda cfg: cfg)  # the model and prompts are not what is tested
    monkeypatch.setattr(cli, "load_inputs", lambda cfg: SimpleNamespace(train=None))
    monkeypatch.setattr(cli, "check_prompts", lambda *args, **kwargs: None)
    monkeypatch.setattr(build, "check_identity", lambda *args, **kwargs: None)
    started = []

    def load_the_checkpoint(cfg, inputs, point):  # what build.resume does with an engine that finds a bad hash
        started.append(point.step)
        if point.step == 2:
            raise DamagedOnLoad(point.path, "policy/__0_0.distcp does not match its sha256")

    monkeypatch.setattr(cli, "run_training", load_the_checkpoint)
    log_dir = tmp_path / "run"
    save_two(log_dir / "checkpoints")
    with caplog.at_level(logging.WARNING):
        assert cli.main([f"logger.log_dir={log_dir}", "grpo.max_steps=4"]) == 0
    assert started == [2, 1]
    assert f"checkpoint {log_dir / 'checkpoints/step_2'} is damaged and skipped: policy/__0_0.distcp" in caplog.text


def test_each_checkpoint_the_engine_finds_damaged_is_warned_about_once(tmp_path, caplog, monkeypatch):
    """Every checkpoint damaged on load: each restart passes over the ones found before without warning again,
    and the run stops (exit 2) naming both."""
    import grpo_app.build as build
    import grpo_app.main as cli
    from grpo_app.checkpoint import DamagedOnLoad

    monkeypatch.setattr(cli, "preflight", lambda cfg: cfg)
    monkeypatch.setattr(cli, "load_inputs", lambda cfg: SimpleNamespace(train=None))
    monkeypatch.setattr(cli, "check_prompts", lambda *args, **kwargs: None)
    monkeypatch.setattr(build, "check_identity", lambda *args, **kwargs: None)

    def every_load_fails(cfg, inputs, point):
        raise DamagedOnLoad(point.path, f"{point.path}/policy/__0_0.distcp does not match its sha256")

    monkeypatch.setattr(cli, "run_training", every_load_fails)
    log_dir = tmp_path / "run"
    save_two(log_dir / "checkpoints")
    with caplog.at_level(logging.WARNING):
        assert cli.main([f"logger.log_dir={log_dir}", "grpo.max_steps=4"]) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for step in ("step_1", "step_2"):
        assert len([w for w in warnings if f"{step}/policy" in w]) == 1, warnings
    assert "no intact checkpoint" in caplog.records[-1].getMessage()


def test_resume_turns_the_engines_hash_error_into_a_restart_from_an_older_checkpoint(tmp_path):
    """build.resume: a CheckpointError from the policy's load (a Ray error that is one by its cause) names the
    checkpoint, for main to pass over."""
    from grpo_app.build import resume
    from grpo_app.checkpoint import DamagedOnLoad

    def load_checkpoint(path: str) -> None:
        verify_manifest(path)  # as the engines do first

    save_two(tmp_path)
    flip_byte(tmp_path / "step_2/policy/.metadata")
    run = SimpleNamespace(workers=SimpleNamespace(load_checkpoint=load_checkpoint))
    with pytest.raises(DamagedOnLoad) as damaged:
        resume(run, ResumePoint(tmp_path / "step_2", {"step": 2}))
    assert damaged.value.path == tmp_path / "step_2" and ".metadata does not match its sha256" in damaged.value.reason


def test_no_intact_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    manager = save_two(tmp_path)
    delete(tmp_path / "step_1/trainer_state.json")
    truncate(tmp_path / "step_2/policy/__0_0.distcp")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*step_2.*__0_0.distcp.*step_1.*trainer_state"):
        manager.newest_intact()


def test_empty_run_directory_starts_fresh_and_leftover_temp_dirs_are_not_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="m", higher_is_better=True)
    assert manager.newest_intact() is None
    (tmp_path / ".step_3.tmp-abc/policy").mkdir(parents=True)  # what a kill mid-save leaves
    (tmp_path / "step_3.old").mkdir()
    assert manager.steps() == [] and manager.newest_intact() is None
    manager.save(4, fake_engine_save, {"step": 4})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3.old", "step_4"]


def test_failed_save_leaves_no_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="m", higher_is_better=True)

    def crash(path: str) -> None:
        Path(path).mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        manager.save(1, crash, {"step": 1})
    assert manager.newest_intact() is None and list(tmp_path.iterdir()) == []


def test_keep_top_k_by_metric_and_always_the_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="val/reward_mean", higher_is_better=True)
    for step, metric in [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.7), (5, 0.2)]:
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": metric})
    assert manager.steps() == [2, 4, 5]  # best two (0.9, 0.7) plus the latest
    assert manager.newest_intact().step == 5


def test_keep_top_k_keeps_the_checkpoint_just_saved_not_a_newer_damaged_one(tmp_path, caplog):
    """A damaged step_6 (its manifest gone, its trainer_state.json still reading well) and a run resumed from step_4
    that saves step_5: the damaged one used to outrank step_4 by its score and stand in for 'the latest', so step_4
    and the step_5 just saved were deleted (a kill then rolled back to step_2)."""
    manager = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    for step, metric in [(2, 0.1), (4, 0.5), (6, 0.9)]:
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": metric})
    (tmp_path / "step_6" / "MANIFEST.json").unlink()
    assert manager.newest_intact().step == 4
    manager.keep_top_k = 1
    manager.save(5, fake_engine_save, {"step": 5, "checkpoint_metric": 0.3})
    assert manager.steps() == [4, 5]  # the best intact one and the one just saved
    assert manager.newest_intact().step == 5


def test_a_step_directory_renamed_by_hand_is_no_checkpoint(tmp_path):
    """`step_04` is not `step_4`: read as step 4, it was warned about under a path that does not exist, and the
    next prune renamed step_4 twice (FileNotFoundError, every later run of the directory)."""
    manager = save_two(tmp_path)
    (tmp_path / "step_2").rename(tmp_path / "step_02")
    assert manager.steps() == [1] and manager.newest_intact().step == 1
    manager.keep_top_k = 1
    manager.save(3, fake_engine_save, {"step": 3, "checkpoint_metric": None})
    assert manager.steps() == [3] and (tmp_path / "step_02").is_dir()


def test_a_checkpoint_copied_under_another_step_name_is_skipped(tmp_path, caplog):
    """A copy of step_1 named step_5 resumed 'from step_5 at step 1'; it is skipped as damaged now."""
    import shutil

    manager = save_two(tmp_path)
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_5")
    with caplog.at_level(logging.WARNING):
        assert manager.newest_intact().step == 2
    assert "step_5 is damaged and skipped: its trainer_state.json is of step 1 (copied or renamed?)" in caplog.text


def test_checkpointing_disabled_on_a_run_with_checkpoints_is_refused_and_keeps_its_metrics(tmp_path, caplog,
                                                                                             monkeypatch):
    """It started at step 0 and rewrote metrics.jsonl and the TensorBoard events (a later resume from the
    checkpoints found the history of the steps before them gone)."""
    import grpo_app.main as cli

    monkeypatch.setattr(cli, "preflight", lambda cfg: cfg)
    monkeypatch.setattr(cli, "load_inputs", lambda cfg: None)
    monkeypatch.setattr(cli, "run_training", lambda *args: pytest.fail("the run started"))
    log_dir = tmp_path / "run"
    save_two(log_dir / "checkpoints")
    (log_dir / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    with caplog.at_level(logging.ERROR):
        assert cli.main([f"logger.log_dir={log_dir}", "checkpointing.enabled=false"]) == 2
    assert "checkpointing.enabled=false, but" in caplog.text and "step_2 the newest" in caplog.text
    assert (log_dir / "metrics.jsonl").read_text() == '{"step": 0, "train/loss": 1.0}\n'


def config(*overrides: str):
    return load_config(None, ["policy.model_name=tiny:qwen2", *overrides])


@pytest.mark.parametrize("override", ["policy.model_name=tiny:llama", "env.name=math", "cluster.train_world_size=2",
                                      "policy.dtensor_cfg.tensor_parallel_size=2"])
def test_resume_with_changed_model_layout_or_task_is_refused(override):
    point = ResumePoint(Path("run/checkpoints/step_3"), {"step": 3, "identity": run_identity(config())})
    changed = run_identity(config(override))
    key = override.split("=")[0]
    with pytest.raises(CheckpointError, match=rf"{key}.*allow_config_change=true"):
        check_identity(point, changed, allow_change=False)
    check_identity(point, changed, allow_change=True)  # the explicit override resumes
    check_identity(point, run_identity(config()), allow_change=False)  # unchanged: fine


def test_an_unset_parallel_size_is_the_default_one():
    """`tensor_parallel_size: 1` and no key are one layout; a size set on one side only is a change."""
    explicit = ResumePoint(Path("c"), {"identity": run_identity(config("policy.dtensor_cfg.tensor_parallel_size=1"))})
    check_identity(explicit, run_identity(config()), allow_change=False)
    two = ResumePoint(Path("c"), {"identity": run_identity(config("policy.dtensor_cfg.tensor_parallel_size=2"))})
    with pytest.raises(CheckpointError, match=r"policy.dtensor_cfg.tensor_parallel_size: checkpoint 2, config 1"):
        check_identity(two, run_identity(config()), allow_change=False)


LORA = "policy.dtensor_cfg.lora_cfg"


@pytest.mark.parametrize(("saved", "resumed", "key"), [
    ([], [f"{LORA}.enabled=true"], LORA),  # a full fine-tuning checkpoint resumed with LoRA
    ([f"{LORA}.enabled=true"], [], LORA),  # a LoRA checkpoint resumed without
    ([f"{LORA}.enabled=true"], [f"{LORA}.enabled=true", f"{LORA}.dim=4"], LORA),
    ([f"{LORA}.enabled=true"], [f"{LORA}.enabled=true", f"{LORA}.target_modules=[q_proj]"], LORA),
    ([f"{LORA}.enabled=true"], [f"{LORA}.enabled=true", f"{LORA}.exclude_modules=[q_proj]"], LORA),
    ([], ["policy.megatron_cfg.enabled=true"], "policy.engine"),  # another checkpoint format
    ([], ["policy.optimizer.name=SGD", "policy.optimizer.kwargs={lr: 0.001}"], "policy.optimizer.name"),  # state
    (["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.lora_cfg.enabled=true"],  # the Megatron engine's
     ["policy.megatron_cfg.enabled=true"], "policy.megatron_cfg.lora_cfg"),
])
def test_resume_under_another_engine_or_lora_adapters_is_refused_even_when_changes_are_allowed(saved, resumed, key):
    """Other adapters are other tensors (names, shapes), another engine another format: the load would fail inside
    the policy actor (measured: DCP 'Missing key', 'Size mismatch'; megatron 'not a distributed checkpoint').
    Refused before Ray, naming the key and the way out (export, then a new run); allow_config_change cannot help."""
    point = ResumePoint(Path("run/checkpoints/step_3"), {"step": 3, "identity": run_identity(config(*saved))})
    for allow_change in (False, True):
        with pytest.raises(CheckpointError, match=rf"cannot load into this run \({key}: checkpoint .*not even "
                                                  r"checkpointing.allow_config_change=true.*apps/grpo export "
                                                  r"run/checkpoints/step_3"):
            check_identity(point, run_identity(config(*resumed)), allow_change=allow_change)


def test_lora_adapters_onto_another_base_model_are_refused_before_ray_even_when_changes_are_allowed(tmp_path):
    """A LoRA checkpoint holds the adapters alone: resumed onto another base (the same shapes, other weights) they
    would train a model nobody trained. Refused by the fingerprint of the base's files, before Ray; the same base
    at another path resumes (with allow_config_change, as any changed model_name)."""
    import shutil

    from rl_core.testing.tiny_models import cached_tiny_checkpoint

    base, other = cached_tiny_checkpoint("qwen2"), cached_tiny_checkpoint("qwen2", seed=1)
    moved = shutil.copytree(base, tmp_path / "moved")
    point = ResumePoint(Path("c"), {"identity": run_identity(config(f"policy.model_name={base}", f"{LORA}.enabled=true"))})
    for allow_change in (False, True):
        with pytest.raises(CheckpointError, match=rf"cannot load into this run \({LORA}.base_model: checkpoint .*"
                                                  r"point policy.model_name at the base model the run was trained on"):
            check_identity(point, run_identity(config(f"policy.model_name={other}", f"{LORA}.enabled=true")),
                           allow_change=allow_change)
    check_identity(point, run_identity(config(f"policy.model_name={moved}", f"{LORA}.enabled=true")),
                   allow_change=True)


def test_lora_settings_that_load_resume():
    """dropout regularises the same tensors and changes no output; the order of the module patterns means nothing."""
    point = ResumePoint(Path("c"), {"identity": run_identity(
        config(f"{LORA}.enabled=true", f"{LORA}.target_modules=[q_proj,v_proj]"))})
    resumed = config(f"{LORA}.enabled=true", f"{LORA}.target_modules=[v_proj,q_proj]", f"{LORA}.dropout=0.1")
    check_identity(point, run_identity(resumed), allow_change=False)
    assert run_identity(config()) == run_identity(config(f"{LORA}.enabled=false"))  # no adapters: no key


def test_a_changed_lora_alpha_needs_allow_config_change():
    """alpha loads into the same tensors but rescales the trained update: the resumed policy would not be the
    checkpointed one, so it is a config change like the model's (allowed explicitly, with a warning)."""
    point = ResumePoint(Path("c"), {"identity": run_identity(config(f"{LORA}.enabled=true"))})
    resumed = run_identity(config(f"{LORA}.enabled=true", f"{LORA}.alpha=16"))
    with pytest.raises(CheckpointError, match=rf"{LORA}.alpha: checkpoint 32.0, config 16.0.*allow_config_change"):
        check_identity(point, resumed, allow_change=False)
    check_identity(point, resumed, allow_change=True)
    older = ResumePoint(Path("c"), {"identity": {k: v for k, v in point.state["identity"].items()
                                                 if not k.endswith(".alpha")}})
    check_identity(older, resumed, allow_change=False)  # checkpoints from before alpha was recorded still resume


def test_resume_past_max_steps_is_refused(tmp_path):
    """A finished run restarted with a smaller grpo.max_steps: an error, nothing of the run rewritten."""
    from grpo_app.build import find_resume_point

    cfg = config(f"logger.log_dir={tmp_path}", "grpo.max_steps=6")
    manager = CheckpointManager(cfg.checkpoint_dir, keep_top_k=0, metric=None, higher_is_better=True)
    manager.save(6, fake_engine_save, {"step": 6, "identity": run_identity(cfg)})
    assert find_resume_point(cfg).step == 6  # max_steps reached: resumes (validates and ends)
    with pytest.raises(CheckpointError, match=r"at step 6, past grpo.max_steps=5: set grpo.max_steps >= 6"):
        find_resume_point(config(f"logger.log_dir={tmp_path}", "grpo.max_steps=5"))


def test_a_resume_onto_a_disk_without_room_for_the_next_checkpoint_is_warned_about(tmp_path, caplog, monkeypatch):
    """A run that stopped on a full disk, started again without making room, would train until its next save and
    stop there again: said before Ray starts."""
    from grpo_app.build import find_resume_point

    cfg = config(f"logger.log_dir={tmp_path}", "grpo.max_steps=6")
    manager = CheckpointManager(cfg.checkpoint_dir, keep_top_k=2, metric=None, higher_is_better=True)
    manager.save(3, fake_engine_save, {"step": 3, "identity": run_identity(cfg)})
    size = sum(f.stat().st_size for f in (cfg.checkpoint_dir / "step_3").rglob("*") if f.is_file())
    for free, warned in ((size - 1, True), (size, False)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: SimpleNamespace(total=2**40, free=free))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grpo_app.checkpoint"):
            assert find_resume_point(cfg).step == 3
        assert ("the newest checkpoint, step_3, takes" in caplog.text and "will likely not fit" in caplog.text
                and "lower checkpointing.keep_top_k" in caplog.text) == warned, caplog.text


def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1.0}\n{"step": 1, "a": 2.0}\n{"step": 2, "a"')
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(path) == [{"step": 0, "a": 1.0}, {"step": 1, "a": 2.0}]
    assert "metrics.jsonl:3" in caplog.text
    path.write_text('{"step": 0}\n{"step": 1, "a"\n{"step": 2}\n')  # damage in the middle is not a torn write
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_jsonl(path)


def strict_json(line: str) -> dict:
    def refuse(constant: str):
        raise AssertionError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def test_metrics_are_strict_json_and_resume_drops_repeated_steps(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    for step in range(4):
        sink.log(step, {"loss": float(step), "acc": float("nan") if step == 1 else 0.5, "big": float("inf")})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()[:4]]
    assert records[1] == {"step": 1, "loss": 1.0, "acc": None, "big": None}
    resumed = MetricsSink(tmp_path, tensorboard=False, resume_step=2)
    assert [r["step"] for r in resumed.history] == [0, 1]
    assert [strict_json(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert resumed.series("acc") == ([0], [0.5])


def test_tensorboard_events_past_the_resume_step_are_not_duplicated(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsSink(tmp_path, tensorboard=True, resume_step=None)
    for step in range(5):
        first.log(step, {"loss": 100.0 + step})
    first.close()
    resumed = MetricsSink(tmp_path, tensorboard=True, resume_step=3)
    for step in range(3, 6):
        resumed.log(step, {"loss": 200.0 + step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("loss")]
    assert got == [(0, 100.0), (1, 101.0), (2, 102.0), (3, 203.0), (4, 204.0), (5, 205.0)]


def fake_hf_save(path: str) -> None:
    Path(path).mkdir()
    (Path(path) / "model.safetensors").write_bytes(b"weights")


def stub_run(tmp_path, manager, *overrides: str) -> SimpleNamespace:
    return SimpleNamespace(cfg=config(*overrides, "logger.progress_bar=false"),
                           workers=SimpleNamespace(save_checkpoint=fake_engine_save, save_hf=fake_hf_save),
                           sink=MetricsSink(tmp_path, tensorboard=False, resume_step=None), checkpoints=manager,
                           train_prompts=SimpleNamespace(state_dict=lambda: {}),
                           rollouts=loop.RolloutQueue(lambda step: None, ahead=False, max_steps=0))


def test_each_checkpoint_is_scored_with_its_own_steps_validation(tmp_path, monkeypatch):
    val_by_step = {0: 0.1, 2: 0.9, 4: 0.2, 6: 0.5}  # not monotonic: a stale score ranks differently
    monkeypatch.setattr(loop, "validate", lambda run, step: {"val/reward_mean": val_by_step[step]})
    monkeypatch.setattr(loop, "grpo_step", lambda run, step: {"rollout/reward_mean": 0.0})
    manager = CheckpointManager(tmp_path / "ckpt", keep_top_k=1, metric="val/reward_mean", higher_is_better=True)
    run = stub_run(tmp_path, manager, "grpo.max_steps=6", "grpo.val_every=2", "checkpointing.save_every=1")
    scores = {}
    real_save = manager.save

    def recording_save(step, save_engine, state, **kwargs):
        scores[step] = state["checkpoint_metric"]
        return real_save(step, save_engine, state, **kwargs)

    manager.save = recording_save
    loop.train(run)
    assert scores == {1: None, 2: 0.9, 3: None, 4: 0.2, 5: None, 6: 0.5}
    assert manager.steps() == [2, 6]  # the best (val@2 = 0.9) and the latest
    logged = [(r["step"], r["val/reward_mean"]) for r in run.sink.history if "val/reward_mean" in r]
    assert logged == [(0, 0.1), (2, 0.9), (4, 0.2), (6, 0.5)]  # each validation once, at its own step
    assert all(math.isfinite(v) for _, v in logged)


@pytest.mark.parametrize(("save_hf", "with_hf"), [("final", [5]), ("every", [2, 4, 5]), ("never", [])])
def test_checkpointing_save_hf_puts_the_hf_model_in_the_last_every_or_no_checkpoint(tmp_path, monkeypatch, caplog,
                                                                                     save_hf, with_hf):
    monkeypatch.setattr(loop, "grpo_step", lambda run, step: {"rollout/reward_mean": 0.0})
    manager = CheckpointManager(tmp_path / "ckpt", keep_top_k=5, metric="val/reward_mean", higher_is_better=True)
    run = stub_run(tmp_path, manager, "grpo.max_steps=5", "grpo.val_every=0", "checkpointing.save_every=2",
                   f"checkpointing.save_hf={save_hf}")
    with caplog.at_level(logging.INFO, logger="grpo_app.loop"):
        loop.train(run)
    assert manager.steps() == [2, 4, 5]
    assert [s for s in manager.steps() if (tmp_path / "ckpt" / f"step_{s}" / "hf").is_dir()] == with_hf
    for step in with_hf:  # inside the checkpoint's manifest: a damaged HF copy is a damaged checkpoint
        assert "hf/model.safetensors" in json.loads((tmp_path / "ckpt" / f"step_{step}" / "MANIFEST.json").read_text())["files"]
    announced = [r.getMessage() for r in caplog.records if "Hugging Face model" in r.getMessage()]
    assert announced == ([f"trained policy as a Hugging Face model (transformers, vLLM): {tmp_path / 'ckpt' / 'step_5' / 'hf'}"]
                         if with_hf else [])


def test_a_misspelt_checkpoint_metric_is_reported_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loop, "validate", lambda run, step: {"val/reward_mean": step / 10})
    monkeypatch.setattr(loop, "grpo_step", lambda run, step: {"rollout/reward_mean": 0.0})
    manager = CheckpointManager(tmp_path / "ckpt", keep_top_k=1, metric="val/reward_meen", higher_is_better=True)
    run = stub_run(tmp_path, manager, "grpo.max_steps=4", "grpo.val_every=1", "checkpointing.save_every=1",
                   "checkpointing.metric=val/reward_meen")
    with caplog.at_level(logging.WARNING):
        loop.train(run)
    warnings = [r.getMessage() for r in caplog.records if "checkpointing.metric" in r.getMessage()]
    assert warnings == ["checkpointing.metric='val/reward_meen' is not a metric of this run (did you mean "
                        "'val/reward_mean'?): keep-top-k keeps the newest checkpoints only"]


def test_resuming_a_finished_run_logs_its_final_validation_again(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "validate", lambda run, step: {"val/reward_mean": step / 10})
    run = stub_run(tmp_path, None, "grpo.max_steps=4", "grpo.val_every=2")
    loop.train(run, start_step=4)
    assert run.sink.history == [{"step": 4, "val/reward_mean": 0.4}]


def test_run_directory_without_an_intact_checkpoint_exits_2_and_keeps_its_metrics(tmp_path, caplog, monkeypatch):
    """Through the CLI entry point: the error comes before Ray starts, and nothing is deleted."""
    import grpo_app.main as cli

    monkeypatch.setattr(cli, "preflight", lambda cfg: cfg)  # the model and prompts are not what is tested
    monkeypatch.setattr(cli, "load_inputs", lambda cfg: None)
    monkeypatch.setattr(cli, "run_training", lambda *args: pytest.fail("the run started"))

    log_dir = tmp_path / "run"
    save_two(log_dir / "checkpoints")
    for step in (1, 2):
        delete(log_dir / f"checkpoints/step_{step}/trainer_state.json")  # what the run did silently
    (log_dir / "metrics.jsonl").write_text('{"step": 0, "train/loss": 1.0}\n')
    with caplog.at_level(logging.ERROR):
        assert cli.main([f"logger.log_dir={log_dir}", "grpo.max_steps=2"]) == 2
    assert "no intact checkpoint" in caplog.text and "trainer_state.json is missing" in caplog.text
    assert (log_dir / "metrics.jsonl").read_text() == '{"step": 0, "train/loss": 1.0}\n'


def test_checkpoint_dir_set_to_one_checkpoint_is_refused_not_a_fresh_start(tmp_path):
    """`checkpointing.dir=.../step_3` holds no step_* directory: the run would start over (and write its
    checkpoints inside step_3) instead of resuming."""
    from grpo_app.build import find_resume_point

    cfg = config(f"logger.log_dir={tmp_path / 'run'}")
    CheckpointManager(cfg.checkpoint_dir, keep_top_k=2, metric="m", higher_is_better=True).save(
        3, fake_engine_save, {"step": 3, "identity": run_identity(cfg)})
    one = cfg.checkpoint_dir / "step_3"
    with pytest.raises(CheckpointError, match=rf"one checkpoint.*set checkpointing.dir={cfg.checkpoint_dir} "):
        find_resume_point(config(f"logger.log_dir={tmp_path / 'run2'}", f"checkpointing.dir={one}"))
    assert sorted(p.name for p in one.iterdir()) == ["MANIFEST.json", "policy", "trainer_state.json"]
    resumed = find_resume_point(config(f"logger.log_dir={tmp_path / 'run2'}", f"checkpointing.dir={cfg.checkpoint_dir}"))
    assert resumed.path == one


def examples(n: int, offset: int = 0) -> list[PromptExample]:
    return [PromptExample(prompt=str(i), prompt_token_ids=[i]) for i in range(offset, offset + n)]


def checkpoint_after(items: list[PromptExample], seed: int, num_prompts: int, tmp_path) -> Path:
    """A run directory whose step-1 checkpoint's run had taken `num_prompts` prompts of `items`."""
    source = PromptSource(items, seed)
    source.next_batch(num_prompts)
    cfg = config(f"logger.log_dir={tmp_path}")
    manager = CheckpointManager(cfg.checkpoint_dir, keep_top_k=2, metric="m", higher_is_better=True)
    manager.save(1, fake_engine_save, {"step": 1, "prompts": source.state_dict(), "identity": run_identity(cfg)})
    return tmp_path


def start(log_dir: Path, items: list[PromptExample], monkeypatch, *overrides: str) -> tuple[int, list]:
    """The CLI up to the run: (exit code, the PromptSource the run was given, resumed as build.resume does)."""
    import grpo_app.main as cli

    started = []

    def run_training(cfg, inputs, point):
        inputs.train.load_state_dict(point.state["prompts"])
        started.append(inputs.train)

    monkeypatch.setattr(cli, "preflight", lambda cfg: cfg)
    monkeypatch.setattr(cli, "load_inputs", lambda cfg: RunInputs(tokenizer=None, train=PromptSource(items, 7), val=[]))
    monkeypatch.setattr(cli, "run_training", run_training)
    code = cli.main(["policy.model_name=tiny:qwen2", f"logger.log_dir={log_dir}", "grpo.seed=7", *overrides])
    return code, started


def test_resume_with_fewer_train_prompts_is_refused_before_the_run_starts(tmp_path, monkeypatch, caplog):
    """Before: an IndexError in the first step after the resume (Ray, workers and checkpoint loaded)."""
    log_dir = checkpoint_after(examples(10), 7, 8, tmp_path)
    with caplog.at_level(logging.ERROR):
        code, started = start(log_dir, examples(5), monkeypatch)
    assert (code, started) == (2, [])
    assert "had 10 train prompts and had used 8 of epoch 0; this config gives 5" in caplog.text
    assert "allow_config_change=true" in caplog.text

    code, started = start(log_dir, examples(5), monkeypatch, "checkpointing.allow_config_change=true")
    fresh = PromptSource(examples(5), 7)
    fresh.next_batch(5)  # epoch 0 of the smaller set is over: the resumed run goes on with epoch 1
    assert code == 0 and started[0].next_batch(4) == fresh.next_batch(4)


@pytest.mark.parametrize(("items", "seed"), [(examples(10, offset=100), 7), (examples(10), 8)],
                         ids=["other-prompts", "other-seed"])
def test_resume_on_another_prompt_stream_of_the_same_size_is_refused(tmp_path, monkeypatch, caplog, items, seed):
    log_dir = checkpoint_after(items, seed, 4, tmp_path)
    with caplog.at_level(logging.ERROR):
        code, started = start(log_dir, examples(10), monkeypatch)
    assert (code, started) == (2, [])
    assert "the train prompts (their content or order) or grpo.seed differ" in caplog.text


def test_resume_on_the_same_prompts_continues_where_the_run_stopped(tmp_path, monkeypatch):
    log_dir = checkpoint_after(examples(10), 7, 8, tmp_path)
    uninterrupted = PromptSource(examples(10), 7)
    uninterrupted.next_batch(8)
    code, started = start(log_dir, examples(10), monkeypatch)
    assert code == 0 and started[0].next_batch(6) == uninterrupted.next_batch(6)


class Killed(BaseException):
    """SIGKILL, as far as the code that was running can tell: nothing after it runs."""


def test_a_kill_while_pruning_leaves_no_incomplete_checkpoint(tmp_path, monkeypatch):
    """Before: rmtree of the pruned step_N, killed halfway, left a visible step_N missing files (6 of 25
    random SIGKILLs of a saving process in the audit)."""
    import grpo_app.checkpoint as checkpoint

    manager = CheckpointManager(tmp_path, keep_top_k=2, metric="m", higher_is_better=True)
    for step in (1, 2):
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": None})
    rmtree = checkpoint.shutil.rmtree

    def killed_halfway(path, ignore_errors=False):  # while deleting step_1, whatever its name then
        if "step_1" not in Path(path).name:
            return rmtree(path, ignore_errors=ignore_errors)
        rmtree(Path(path) / "policy")
        raise Killed

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_halfway)
    with pytest.raises(Killed):
        manager.save(3, fake_engine_save, {"step": 3, "checkpoint_metric": None})  # prunes step_1
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    for step_dir in tmp_path.glob("step_*"):  # every visible checkpoint is whole
        verify_manifest(step_dir)
    restarted = CheckpointManager(tmp_path, keep_top_k=2, metric="m", higher_is_better=True)
    assert restarted.newest_intact().step == 3
    restarted.save(4, fake_engine_save, {"step": 4, "checkpoint_metric": None})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]  # the leftover is gone


def test_a_kill_while_replacing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    """Saving step_N again (after a fall-back from a damaged step_N) moves the old one to step_N.old, then the
    new one into place. Before: a kill between the two renames left no step_N (the resume fell back a step)
    and a step_N.old that nothing read or removed."""
    import rl_core.checkpoint_io as checkpoint_io

    manager = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    for step in (1, 2):
        manager.save(step, fake_engine_save, {"step": step, "checkpoint_metric": None, "copy": "first"})
    rename = checkpoint_io.os.rename

    def killed_before_the_new_one_is_in_place(src, dst):
        if Path(src).name.startswith(".step_2.tmp-"):
            raise Killed
        rename(src, dst)

    monkeypatch.setattr(checkpoint_io.os, "rename", killed_before_the_new_one_is_in_place)
    with pytest.raises(Killed):
        manager.save(2, fake_engine_save, {"step": 2, "checkpoint_metric": None, "copy": "second"})
    monkeypatch.setattr(checkpoint_io.os, "rename", rename)
    restarted = CheckpointManager(tmp_path, keep_top_k=3, metric="m", higher_is_better=True)
    point = restarted.newest_intact()
    assert (point.step, point.state["copy"]) == (2, "first")
    restarted.save(3, fake_engine_save, {"step": 3, "checkpoint_metric": None})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_2", "step_3"]


def test_checkpoints_scored_by_another_metric_do_not_outrank_this_runs(tmp_path):
    """A run resumed with another checkpointing.metric: before, the old scores (another quantity) were
    ranked against the new ones, and keep-top-k deleted this run's best checkpoint (step_3 here)."""
    first = CheckpointManager(tmp_path, keep_top_k=1, metric="val/reward_mean", higher_is_better=True)
    for step, reward in [(1, 0.2), (2, 5.0)]:
        first.save(step, fake_engine_save, {"step": step, "checkpoint_metric": reward})
    resumed = CheckpointManager(tmp_path, keep_top_k=1, metric="val/accuracy", higher_is_better=True)
    for step, accuracy in [(3, 0.9), (4, 0.4)]:
        resumed.save(step, fake_engine_save, {"step": step, "checkpoint_metric": accuracy})
    assert resumed.steps() == [3, 4]  # the best accuracy and the latest
