"""The trainer's usage lines and the commands its messages suggest name the command that was run: `grpo`, the
console script the grpo-app wheel installs, or `uv run apps/grpo`, the apps/grpo directory (`usage: uv run apps/grpo`
was printed whichever ran)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_app import cli, evaluate, export
from grpo_app.preflight import model_dir_problem

APP = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_the_console_script_the_trainer_recognises():
    scripts = tomllib.loads((APP / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"grpo": "grpo_app.cli:main"}


@pytest.mark.parametrize(("argv0", "prog"), [("/opt/venv/bin/grpo", "grpo"), (str(APP), "uv run apps/grpo"),
                                             ("apps/grpo", "uv run apps/grpo")])
def test_usage_lines_and_hints_name_the_command_that_ran(monkeypatch, capsys, tmp_path, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    for parse, usage in ((cli.parse_args, prog), (export.parse_args, f"{prog} export"),
                         (evaluate.parse_args, f"{prog} eval")):
        with pytest.raises(SystemExit):
            parse(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: {usage} [-h]")
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    assert f"\n  {prog} grpo.max_steps=5\n  {prog} --config gpu_1x" in capsys.readouterr().out  # the examples
    with pytest.raises(SystemExit):
        cli.parse_args(["--config", "x", "eval"])
    assert f"'eval' is a subcommand and comes first: {prog} eval [its options]" in capsys.readouterr().err
    (tmp_path / "checkpoints/step_1/policy").mkdir(parents=True)
    assert f"write one with `{prog} export {tmp_path}`" in model_dir_problem(str(tmp_path))


def test_the_installed_script_and_the_directory_print_their_own_usage_without_importing_torch_or_ray():
    """The real processes: the console script uv installed beside this interpreter, and the directory as uv runs it.
    `--help` and a mistyped option answer before the trainer's imports (torch and Ray: ~1.5 s, a third of `uv run
    apps/grpo --help`); Python's own import log (PYTHONPROFILEIMPORTTIME) says which modules were imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    for command, usage in (([str(Path(sys.executable).parent / "grpo")], "usage: grpo [-h]"),
                           ([sys.executable, "apps/grpo"], "usage: uv run apps/grpo [-h]")):
        for args, code, stream in ((["--help"], 0, "stdout"), (["--log-levl", "debug"], 2, "stderr")):
            proc = subprocess.run([*command, *args], cwd=APP.parents[1], env=env, capture_output=True, text=True,
                                  timeout=300)
            log = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
            out = proc.stdout if stream == "stdout" else proc.stderr.replace("\n".join(log), "")
            assert proc.returncode == code and usage in out, proc.stdout[:500] + proc.stderr[-2000:]
            imported = {line.rsplit("|", 1)[-1].strip() for line in log}
            assert "grpo_app.cli" in imported and not imported & {"torch", "ray", "grpo_app.main"}, (args, command)
