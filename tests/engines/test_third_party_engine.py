"""A third engine plugs in through its entry point alone: `policy.engine=toy` trains a GRPO step with it.

The toy package (toy_engine/, with its own pyproject.toml) is made visible to `importlib.metadata` the
way an installed wheel is: a `.dist-info` directory with its METADATA and the entry_points.txt built from
that pyproject.toml, on the trainer subprocess's PYTHONPATH (no build or install step needed).
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_grpo_e2e import ROOT, grpo_command, read_metrics  # noqa: E402

TOY = Path(__file__).with_name("toy_engine")


def write_dist_info(site: Path) -> None:
    """What pip would write for toy_engine: METADATA and entry_points.txt, from its pyproject.toml."""
    project = tomllib.loads((TOY / "pyproject.toml").read_text())["project"]
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines += [f"[{group}]", *(f"{name} = {target}" for name, target in entries.items()), ""]
    (dist_info / "entry_points.txt").write_text("\n".join(lines))


@pytest.mark.slow
def test_entry_point_engine_trains_one_grpo_step(tmp_path):
    import subprocess

    site = tmp_path / "site"
    write_dist_info(site)
    python_path = os.pathsep.join([str(site), str(TOY / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "RL_STACK_CACHE": str(tmp_path / "cache")}
    log_dir = tmp_path / "run"
    cmd = grpo_command(log_dir, "policy.engine=toy", "grpo.max_steps=1", "grpo.val_every=0",
                       "checkpointing.enabled=false", "env.num_workers=0", "generation.in_policy_workers=true")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (step,) = [r for r in read_metrics(log_dir) if "train/loss" in r]
    assert step["train/toy_engine_steps"] == 1.0  # ToyEngine.train_batch ran, found by its entry point only
    assert step["train/grad_norm"] > 0.0
