"""`uv run apps/grpo export`: a real run's checkpoint, from either engine, becomes a Hugging Face model directory
that transformers loads, holding the weights the engine itself restores from that checkpoint; refusals exit 2.

The reference is independent of the offline converters: the run's engine class, built on one rank, loads the
checkpoint (`load_checkpoint`, its resume path) and streams `export_hf_weights` (its refit path).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import grpo_app.export as export_module
from grpo_app.config import load_config
from grpo_app.main import main
from grpo_app.preflight import resolve_model
from rl_core.testing.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[3]
RUN = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
       "policy.train_micro_batch_size=8", "grpo.num_val_prompts=8", "generation.max_new_tokens=8",
       "logger.tensorboard=false", "logger.progress_bar=false", "logger.plot=false", "grpo.max_steps=1",
       "grpo.val_every=0"]
ENGINE_OVERRIDES = {"dtensor": [], "megatron": ["policy.megatron_cfg.enabled=true"]}


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
def test_export_refusals_exit_2_naming_the_fix(trained_run, caplog, tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run("dtensor"), run)
    (run / "hf").mkdir(exist_ok=True)
    (run / "hf/step_1").mkdir(exist_ok=True)
    code, line = _export(caplog, str(run))
    assert code == 2 and "hf/step_1 already exists; remove it or choose another --out" in line

    code, line = _export(caplog, str(tmp_path / "nope"))
    assert code == 2 and "does not exist: pass a run directory" in line

    moved = tmp_path / "elsewhere"
    shutil.copytree(run / "checkpoints", moved)  # checkpointing.dir outside the run: no config.yaml above
    code, line = _export(caplog, str(moved / "step_1"), "--out", str(tmp_path / "o1"))
    assert code == 2 and "config.yaml is missing: pass the run's resolved config with --config FILE" in line
    code, _ = _export(caplog, str(moved / "step_1"), "--config", str(run / "config.yaml"), "--out",
                      str(tmp_path / "o1"))
    assert code == 0 and (tmp_path / "o1/config.json").is_file()

    victim = next((run / "checkpoints/step_1/policy").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:64])  # truncated
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
