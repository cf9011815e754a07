"""Run settings checked before the run: the lr schedule against the run's length, checkpoint scoring, a run that
saves no model, and `~` in path keys; and that those errors come before the engine's imports."""

from __future__ import annotations

import logging
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_app.config import load_config
from grpo_app.preflight import preflight
from rl_core.config import ConfigError
from rl_core.testing.tiny_models import cached_tiny_checkpoint

SMALL = ["grpo.num_val_prompts=4", "logger.tensorboard=false"]


def test_a_decaying_schedule_shorter_than_the_run_is_warned_about(caplog):
    """total_steps=2 with linear decay on a 3-step run: the lr was 0 from step 2 on, without a word."""
    from grpo_app.preflight import check_schedule

    cfg = load_config(None, ["grpo.max_steps=3", "policy.scheduler.decay=linear", "policy.scheduler.total_steps=2"])
    with caplog.at_level(logging.WARNING, logger="grpo_app.preflight"):
        check_schedule(cfg)
    assert "policy.scheduler.total_steps=2 is fewer than this run's 3 optimizer steps" in caplog.text
    caplog.clear()
    check_schedule(load_config(None, ["grpo.max_steps=3", "policy.scheduler.decay=linear",
                                      "policy.scheduler.total_steps=3"]))
    assert not caplog.text


def test_a_decaying_schedule_longer_than_the_run_is_warned_about(caplog):
    """cosine with the default total_steps=1000 on the default 100-step run ended at 0.977 x lr, without a word."""
    from grpo_app.preflight import check_schedule

    with caplog.at_level(logging.WARNING, logger="grpo_app.preflight"):
        check_schedule(load_config(None, ["policy.scheduler.decay=cosine"]))
    factor = 0.5 * (1 + math.cos(math.pi * 97 / 998))  # independent: cosine at step 99 of 1000, 2 of them warmup
    assert (f"policy.scheduler.total_steps=1000 is more than this run's 100 optimizer steps (grpo.max_steps=100): the "
            f"cosine decay ends the run at {factor:.3g} x lr, not at min_lr_ratio=0") in caplog.text
    caplog.clear()
    check_schedule(load_config(None, ["policy.scheduler.decay=cosine", "policy.scheduler.total_steps=100"]))
    assert not caplog.text


def test_a_path_starting_with_a_tilde_is_in_the_home_directory(tmp_path, monkeypatch):
    """`logger.log_dir=~/runs/x` on a command line reaches Python unexpanded (the shell expands `~` only at the start of
    a word): the run was written to a directory named `~` in the working directory, its log reading like home."""
    shutil.copytree(cached_tiny_checkpoint("qwen2"), tmp_path / "models" / "m")
    (tmp_path / "p.jsonl").write_text('{"prompt": "h:1"}\n' * 4)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path / "models")
    cfg = preflight(load_config(None, [*SMALL, "logger.log_dir=~/runs/x", "checkpointing.dir=~/ckpt",
                                       "policy.model_name=~/models/m", "env.train_data=~/p.jsonl",
                                       "env.val_data=~/p.jsonl"]))
    assert cfg.logger.log_dir == f"{tmp_path}/runs/x" and str(cfg.checkpoint_dir) == f"{tmp_path}/ckpt"
    assert cfg.policy.model_name == f"{tmp_path}/models/m"
    assert cfg.env.train_data == cfg.env.val_data == f"{tmp_path}/p.jsonl"


def test_checkpointing_is_checked_before_the_run(caplog):
    """A run without checkpoints saves no model, which it did without a word. A misspelt validation metric was a warning at the first checkpoint (keep-top-k then kept the newest); a
    validation that never scores a checkpoint was not mentioned. Every shipped recipe scores all of its own."""
    from grpo_app.config import CONFIG_DIR
    from grpo_app.preflight import check_checkpointing

    with pytest.raises(ConfigError, match=r"checkpointing.metric='val/reward_meen' is not a validation metric; they are "
                                          r"\['val/reward_mean', 'val/accuracy'\] \(did you mean 'val/reward_mean'\?\)"):
        check_checkpointing(load_config(None, ["checkpointing.metric=val/reward_meen"]))
    with caplog.at_level(logging.WARNING, logger="grpo_app.preflight"):
        check_checkpointing(load_config(None, ["grpo.val_every=0"]))
        check_checkpointing(load_config(None, ["grpo.val_every=3"]))
        check_checkpointing(load_config(None, ["checkpointing.metric=train/loss", "grpo.val_every=0"]))
        check_checkpointing(load_config(None, ["checkpointing.enabled=false"]))  # ran, exit 0, and saved no model
        check_checkpointing(load_config(None, ["checkpointing.enabled=false", "checkpointing.save_hf=never"]))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "checkpointing.metric=val/reward_mean with grpo.val_every=0",
        "checkpointing.save_every=20 is not a multiple of grpo.val_every=3",
        "checkpointing.enabled=false"]
    caplog.clear()
    for recipe in sorted(CONFIG_DIR.glob("*.yaml")):
        check_checkpointing(load_config(recipe, []))
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_config_errors_that_need_no_engine_come_before_its_imports():
    """A wrong env, schedule or checkpointing key is found before the engine's package is imported (torch
    distributed, megatron-core: seconds of a user's wait for a typo). A fresh interpreter, where nothing is
    imported yet."""
    probe = ("import sys; from grpo_app.config import load_config; from grpo_app.preflight import preflight\n"
             "from rl_core.config import ConfigError\n"
             "try: preflight(load_config(overrides=[sys.argv[1]]))\n"
             "except ConfigError as exc: print('error:', exc)\n"
             "print('imported:', sorted(m for m in sys.modules if m.startswith(('engine_dtensor', 'engine_megatron'))))")
    for override, error in (("env.name=chess", "env.name='chess' is not known"),
                            ("checkpointing.metric=val/nope", "checkpointing.metric='val/nope' is not a validation metric"),
                            ("policy.megatron_cfg.enabled=true", None)):  # the control: the probe sees an import
        proc = subprocess.run([sys.executable, "-c", probe, override], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 0, proc.stderr[-2000:]
        if error is None:
            assert "imported: []" not in proc.stdout and "engine_megatron" in proc.stdout, proc.stdout
        else:
            assert error in proc.stdout and "imported: []" in proc.stdout, proc.stdout
