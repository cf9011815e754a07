"""`uv run apps/grpo export`: a real run's checkpoint, from either engine, becomes a Hugging Face model directory
that transformers loads, holding the weights the engine itself restores from that checkpoint; refusals exit 2.

The reference is independent of the offline converters: the run's engine class, built on one rank, loads the
checkpoint (`load_checkpoint`, its resume path) and streams `export_hf_weights` (its refit path).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

import grpo_app.export as export_module
from grpo_app.checkpoint import CheckpointManager, run_identity
from grpo_app.config import load_config
from grpo_app.main import main
from grpo_app.preflight import resolve_model
from rl_core.checkpoint_io import MANIFEST_FILE, atomic_dir, verify_manifest, write_manifest
from rl_core.config import to_dict
from rl_core.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[3]
# 4 x 16 completions of 8 tokens: the random model draws the target character (p ~1/128 a token) a few times, so the
# one step has advantages to train on (as tests/test_grpo_e2e.py's SMALL; 4 x 4 could all score 0, and then the
# step changes nothing)
RUN = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=16", "policy.train_global_batch_size=64",
       "policy.train_micro_batch_size=8", "grpo.num_val_prompts=8", "generation.max_new_tokens=8", "env.kwargs.answer_len=8",
       "logger.tensorboard=false", "logger.progress_bar=false", "logger.plot=false", "grpo.max_steps=1",
       "grpo.val_every=0"]
ENGINE_OVERRIDES = {"dtensor": [], "megatron": ["policy.megatron_cfg.enabled=true"],
                    "dtensor-lora": ["policy.dtensor_cfg.lora_cfg.enabled=true"],
                    "megatron-lora": ["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.lora_cfg.enabled=true"]}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Callable[[str], Path]:
    """engine -> the log_dir of a one-step run through Ray with it (run once per engine, ~20-30 s each)."""
    runs: dict[str, Path] = {}

    def get(engine: str) -> Path:
        if engine not in runs:
            root = tmp_path_factory.mktemp(f"run-{engine}")
            env = {**os.environ, "RL_STACK_CACHE": str(root / "cache")}
            proc = subprocess.run([sys.executable, str(ROOT / "apps/grpo"), *RUN, *ENGINE_OVERRIDES[engine],
                                   f"logger.log_dir={root / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, f"grpo failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
            runs[engine] = root / "run"
        return runs[engine]

    return get


def _engine_weights(rank: int, world: int, policy, policy_dir: str) -> dict[str, torch.Tensor]:
    """What the engine restores from its checkpoint, as its refit streams it."""
    from rl_core.registry import create_engine

    engine = create_engine(policy)
    engine.load_checkpoint(policy_dir)
    return {name: tensor.clone() for name, tensor in engine.export_hf_weights()}


def _export(caplog, *args: str) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="grpo.export"):
        code = main(["export", *args])
    return code, "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_export_of_a_run_is_the_checkpointed_policy(trained_run, caplog, engine: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = trained_run(engine)
    assert _export(caplog, str(run)) == (0, "")  # the run directory: its newest intact checkpoint
    out = run / "hf/step_1"  # the default --out: <log_dir>/hf/step_N, beside the checkpoints, not in one
    policy = resolve_model(load_config(run / "config.yaml")).policy
    reference = run_distributed(_engine_weights, 1, args=(policy, str(run / "checkpoints/step_1/policy")))[0]
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)

    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(policy.model_name, dtype=torch.float32)
    trained = dict(loaded.named_parameters())
    assert all(torch.equal(trained[k], reference[k]) for k in reference)
    assert any(not torch.equal(p, trained[k]) for k, p in initial.named_parameters())  # the step changed it
    assert (out / "tokenizer.json").is_file()

    one = run / "one"  # one checkpoint directory as PATH, with an explicit --out
    assert _export(caplog, str(run / "checkpoints/step_1"), "--out", str(one)) == (0, "")
    assert load_file(str(one / "model.safetensors")).keys() == exported.keys()


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["dtensor-lora", "megatron-lora"])
def test_export_of_a_lora_run_writes_the_adapter_its_checkpoint_holds(trained_run, caplog, engine: str) -> None:
    """A LoRA run's checkpoint holds, inside its manifested `hf/`, the adapter in PEFT format; the offline export
    writes the same adapter, tensor for tensor, beside the same merged weights."""
    from safetensors.torch import load_file

    run = trained_run(engine)
    checkpoint = run / "checkpoints/step_1"
    verify_manifest(checkpoint)  # the trainer's manifest lists the adapter's files
    listed = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    if "hf/MANIFEST.json" in listed:  # the DTensor engine's hf/ has a manifest of its own, the Megatron engine's not
        listed = {f"hf/{name}" for name in json.loads((checkpoint / "hf" / MANIFEST_FILE).read_text())["files"]}
    assert {"hf/adapter/adapter_config.json", "hf/adapter/adapter_model.safetensors"} <= set(listed)

    assert _export(caplog, str(run)) == (0, "")
    live, out = checkpoint / "hf", run / "hf/step_1"
    assert "the LoRA adapter alone (peft, vLLM --enable-lora; on " in caplog.text and str(out / "adapter") in caplog.text
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        exported, saved = load_file(str(out / name)), load_file(str(live / name))
        assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    adapter = load_file(str(out / "adapter/adapter_model.safetensors"))
    assert any(torch.count_nonzero(t) for k, t in adapter.items() if k.endswith(".lora_B.weight"))  # B trained
    assert (out / "adapter/adapter_config.json").read_text() == (live / "adapter/adapter_config.json").read_text()
    _assert_base_model_option(run, caplog, live)


def _assert_base_model_option(run: Path, caplog, live: Path) -> None:
    """The checkpoint holds the adapters alone: `--base-model` finds the base where it is now (the same merged
    weights), and refuses a directory that is gone or holds another model."""
    from safetensors.torch import load_file

    from rl_core.testing.tiny_models import cached_tiny_checkpoint

    base = resolve_model(load_config(run / "config.yaml")).policy.model_name
    moved = shutil.copytree(base, run / "moved-base")
    assert _export(caplog, str(run), "--out", str(run / "from-moved"), "--base-model", str(moved)) == (0, "")
    exported, saved = load_file(str(run / "from-moved/model.safetensors")), load_file(str(live / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    code, line = _export(caplog, str(run), "--out", str(run / "o"), "--base-model", str(run / "gone"))
    assert code == 2 and line.startswith(f"--base-model {run / 'gone'}: no such directory"), line
    other = str(cached_tiny_checkpoint("qwen2", seed=1))
    code, line = _export(caplog, str(run), "--out", str(run / "o"), "--base-model", other)
    assert code == 2 and f"the base directory this run uses, {other}, holds another model" in line, line
    assert "--base-model DIR" in line and not (run / "o").exists()


@pytest.mark.distributed
def test_export_refusals_exit_2_naming_the_fix(trained_run, caplog, tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run("dtensor"), run)
    (run / "hf").mkdir(exist_ok=True)
    (run / "hf/step_1").mkdir(exist_ok=True)
    code, line = _export(caplog, str(run))
    assert code == 2 and "hf/step_1 already exists; remove it or choose another --out" in line

    code, line = _export(caplog, str(tmp_path / "nope"))
    assert code == 2 and "does not exist: pass a run directory" in line
    for inside in (run / "checkpoints", run / "checkpoints/step_1/policy"):  # it said: pass --config FILE
        code, line = _export(caplog, str(inside))
        assert code == 2 and (f"{inside} is neither a run directory nor one of its checkpoints/step_N: pass {run} "
                              f"(its newest intact checkpoint) or {run}/checkpoints/step_N") in line, line

    moved = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints", moved)  # checkpointing.dir outside the run: no config.yaml above
    code, line = _export(caplog, str(moved / "step_1"), "--out", str(tmp_path / "o1"))
    assert code == 2 and "config.yaml is missing: pass the run's resolved config with --config FILE" in line
    code, _ = _export(caplog, str(moved / "step_1"), "--config", str(run / "config.yaml"), "--out",
                      str(tmp_path / "o1"))
    assert code == 0 and (tmp_path / "o1/config.json").is_file()

    victim = next((run / "checkpoints/step_1/policy").glob("*.distcp"))
    intact = victim.read_bytes()
    victim.write_bytes(intact[:100] + bytes([intact[100] ^ 1]) + intact[101:])  # one changed byte: the engine's
    for path in (run, run / "checkpoints/step_1"):                                # checkpoint_to_hf hashes it
        code, line = _export(caplog, str(path), "--out", str(tmp_path / "o2"))
        assert code == 2 and f"{victim.name} does not match its sha256" in line
    victim.write_bytes(intact[:64])  # truncated
    code, line = _export(caplog, str(run), "--out", str(tmp_path / "o2"))
    assert code == 2 and "no intact checkpoint" in line and victim.name in line
    code, line = _export(caplog, str(run / "checkpoints/step_1"), "--out", str(tmp_path / "o2"))
    assert code == 2 and victim.name in line
    assert not (tmp_path / "o2").exists()

    class NoExport:  # an engine class without the optional classmethod
        pass

    monkeypatch.setattr(export_module.ENGINES, "get", lambda name, config_key: NoExport)
    code, line = _export(caplog, str(moved / "step_1"), "--config", str(run / "config.yaml"), "--out",
                         str(tmp_path / "o3"))
    assert code == 2 and "engine 'dtensor' (" in line and "NoExport) cannot convert its checkpoints offline" in line


def _fake_run(root: Path, *overrides: str) -> Path:
    """A run directory as the trainer leaves it (config.yaml, checkpoints/step_1 with its manifest), without
    training: what plan_export reads before any conversion."""
    cfg = load_config(None, ["policy.model_name=tiny:qwen2", f"logger.log_dir={root}", *overrides])
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def save_engine(path: str) -> None:
        Path(path).mkdir()
        (Path(path) / ".metadata").write_bytes(b"dcp")
        write_manifest(Path(path))

    CheckpointManager(root / "checkpoints", keep_top_k=2, metric="m", higher_is_better=True).save(
        1, save_engine, {"step": 1, "identity": run_identity(resolve_model(cfg))})
    return root


def test_export_into_a_checkpoint_is_refused(tmp_path, caplog) -> None:
    """keep-top-k deletes step_N whole, with an export inside it, and a new step_N beside the checkpoints reads as a
    damaged one; refused before any conversion, naming the default. Beside them under another name is fine."""
    run = _fake_run(tmp_path / "run")
    for out in (run / "checkpoints/step_1/hf2", run / "checkpoints/step_1/policy/x", run / "checkpoints/step_7"):
        code, line = _export(caplog, str(run / "checkpoints/step_1"), "--out", str(out))
        assert code == 2 and "inside a checkpoint or takes a checkpoint's name" in line, line
        assert "<log_dir>/hf/step_N" in line and not out.exists()
    plan, _ = export_module.plan_export(run / "checkpoints/step_1", None, str(run / "checkpoints/step_1/../my-model"))
    assert plan.out.resolve() == run / "checkpoints/my-model"


@pytest.mark.parametrize("edit", [["policy.megatron_cfg.enabled=true"], ["policy.model_name=tiny:llama"]])
def test_export_under_an_edited_config_is_refused_naming_the_key(tmp_path, caplog, edit) -> None:
    """config.yaml edited after the run (or another run's): the model or engine it names is not the checkpoint's, so
    the conversion would fail on a missing tensor or, where shapes agree, use another model's config and tokenizer."""
    run = _fake_run(tmp_path / "run")
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(to_dict(load_config(run / "config.yaml", edit)), sort_keys=False))
    code, line = _export(caplog, str(run), "--config", str(edited), "--out", str(tmp_path / "out"))
    key = "policy.engine" if "megatron" in edit[0] else "policy.model_name"
    assert code == 2 and f"was not written under this config ({key}: checkpoint " in line, line
    assert "--config FILE" in line and not (tmp_path / "out").exists()


def test_a_moved_base_model_is_named_with_the_option(tmp_path, caplog) -> None:
    """The run's policy.model_name is gone (a LoRA checkpoint holds the adapters alone and needs it): the error names
    the directory and --base-model, before any conversion."""
    from rl_core.testing.tiny_models import cached_tiny_checkpoint

    base = shutil.copytree(cached_tiny_checkpoint("qwen2"), tmp_path / "base")
    run = _fake_run(tmp_path / "run", f"policy.model_name={base}")
    shutil.rmtree(base)
    code, line = _export(caplog, str(run), "--out", str(tmp_path / "out"))
    assert code == 2 and f"policy.model_name='{base}': no such directory" in line, line
    assert line.endswith("if the run's base model has moved, pass its directory with --base-model DIR")
    assert not (tmp_path / "out").exists()


def test_interrupted_export_exits_130_and_leaves_no_output(tmp_path, caplog, monkeypatch) -> None:
    """Ctrl-C in the middle of writing: the temporary directory is removed, one line, no traceback."""
    run = _fake_run(tmp_path / "run")
    out = tmp_path / "out"

    def interrupted(checkpoint_dir: str, out_dir: str, *, model_dir: str) -> None:
        with atomic_dir(out_dir, replace=False) as tmp:  # as the converters write
            (tmp / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt

    monkeypatch.setattr(export_module.ENGINES.get("dtensor", config_key="k"), "checkpoint_to_hf",
                        staticmethod(interrupted))
    assert _export(caplog, str(run), "--out", str(out)) == (130, "export stopped: interrupted; no output directory "
                                                                 "was written")
    assert list(tmp_path.iterdir()) == [run]


def test_a_relative_checkpoint_path_finds_the_run_config(tmp_path, monkeypatch) -> None:
    """`export step_1` from checkpoints/, or `export .` from inside the checkpoint: the config two levels up and the
    default --out <log_dir>/hf/step_1, as for the absolute path (not ./config.yaml, not <log_dir>/hf/)."""
    run = _fake_run(tmp_path / "run")
    for cwd, arg in ((run / "checkpoints", "step_1"), (run / "checkpoints/step_1", "."), (run, "checkpoints/step_1")):
        monkeypatch.chdir(cwd)
        plan, _ = export_module.plan_export(Path(arg), None, None)
        assert (plan.checkpoint, plan.out) == (run / "checkpoints/step_1", run / "hf/step_1"), (cwd, arg)
