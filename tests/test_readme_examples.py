"""Every package README's example runs as written: its ```python blocks, in order, in a fresh process.

Each README is one subprocess (cwd: a temp dir, so files the example writes land there; tiny models come
from rl_core.testing.tiny_models, built locally and cached under RL_STACK_CACHE).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted(ROOT.glob("packages/*/README.md"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(readme: Path) -> str:
    return "\n".join(PYTHON_BLOCK.findall(readme.read_text()))


def test_every_package_readme_has_an_example():
    assert READMES and all(python_blocks(r) for r in READMES), [r.parent.name for r in READMES if not python_blocks(r)]


@pytest.mark.parametrize("readme", READMES, ids=[r.parent.name for r in READMES])
def test_readme_example_runs(readme: Path, tmp_path: Path) -> None:
    cache = os.environ.get("RL_STACK_CACHE", str(Path.home() / ".cache" / "rl-stack"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(RL_STACK_CACHE=cache, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", python_blocks(readme)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{readme.relative_to(ROOT)}'s example failed:\n{proc.stderr[-4000:]}"
