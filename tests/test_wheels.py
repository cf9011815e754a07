"""Each package builds a wheel that installs alone, with only its declared dependencies.

Builds every workspace wheel with `uv build`, then installs `rl-core` and `rl-core engine-megatron` into
fresh virtual environments from those wheels (third-party packages come from uv's cache or the index)
and imports them there (engine-megatron's README example runs there too): the user path
`pip install rl-core engine-megatron`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTS = ["rl-core", "rl-seqpack", "engine-dtensor", "engine-megatron", "ckpt-convert", "rl-rollout", "grpo-app"]
MODULES = {"rl-seqpack": "seqpack", "rl-rollout": "rollout"}  # "seqpack" and "rollout" on PyPI are other projects
UV = shutil.which("uv")

pytestmark = pytest.mark.skipif(UV is None, reason="needs uv on PATH")


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    for dist in DISTS:
        subprocess.run([UV, "build", "--package", dist, "--wheel", "-o", str(out)], cwd=ROOT, check=True,
                       capture_output=True)
    return out


def test_every_package_builds_a_wheel_with_its_module(wheel_dir):
    for dist in DISTS:
        module = MODULES.get(dist, dist.replace("-", "_"))
        [wheel] = wheel_dir.glob(f"{dist.replace('-', '_')}-0.1.0-*.whl")
        names = zipfile.ZipFile(wheel).namelist()
        assert f"{module}/__init__.py" in names, f"{wheel.name} lacks {module}/__init__.py"
        assert f"{module}/py.typed" in names, f"{wheel.name} lacks {module}/py.typed"
    [app] = wheel_dir.glob("grpo_app-0.1.0-*.whl")
    assert "grpo_app/configs/cpu_default.yaml" in zipfile.ZipFile(app).namelist()  # `grpo` needs its configs


def _install_and_import(wheel_dir: Path, venv: Path, requirements: list[str], code: str) -> str:
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    # scripts/test.sh compiles the suite's environment to bytecode; a throw-away venv imports torch once
    env = {k: v for k, v in os.environ.items() if k != "UV_COMPILE_BYTECODE"}
    subprocess.run([UV, "pip", "install", "-q", "--python", str(python), "--find-links", str(wheel_dir), *requirements],
                   check=True, capture_output=True, text=True, env=env)
    result = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return result.stdout


@pytest.mark.slow
def test_rl_core_installs_alone(wheel_dir, tmp_path):
    code = (
        "import importlib.metadata as md, torch\n"
        "from rl_core.losses import clipped_pg_loss\n"
        "lp = torch.zeros(3)\n"
        "loss, _ = clipped_pg_loss(lp, lp, torch.ones(3), torch.ones(3), torch.zeros(3, dtype=torch.long),"
        " num_valid_tokens=3, num_valid_seqs=1)\n"
        "names = sorted(d.metadata['Name'] for d in md.distributions())\n"
        "print(float(loss), 'transformers' in names, 'rl-seqpack' in names)\n"
    )
    assert _install_and_import(wheel_dir, tmp_path / "venv", ["rl-core"], code).split() == ["-1.0", "False", "False"]


@pytest.mark.slow
def test_megatron_engine_installs_without_the_trainer(wheel_dir, tmp_path):
    code = (
        "import importlib.metadata as md\n"
        "from rl_core.registry import ENGINES\n"
        "cls = ENGINES.get('megatron', config_key='policy.megatron_cfg.enabled')\n"
        "names = {d.metadata['Name'] for d in md.distributions()}\n"
        "print(cls.__name__, 'ray' in names, 'engine-dtensor' in names, 'grpo-app' in names)\n"
    )
    out = _install_and_import(wheel_dir, tmp_path / "venv", ["rl-core", "engine-megatron"], code)
    assert out.split() == ["MegatronEngine", "False", "False", "False"]
    # and its README's example runs there, checkpoint included: megatron's checkpoint writer needs psutil, which
    # megatron-core does not declare; without it the writer processes died and the save waited for them forever
    example = "\n".join(re.findall(r"^```python\n(.*?)^```", (ROOT / "packages/engine-megatron/README.md").read_text(),
                                    re.S | re.M))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(RL_STACK_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    run = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", example], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and (tmp_path / "ckpt" / "step_10").is_dir(), run.stderr[-4000:]
