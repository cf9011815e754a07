"""The trainer's usage lines and the commands its messages suggest name the command that was run: `grpo`, the
console script the grpo-app wheel installs, or `uv run apps/grpo`, the apps/grpo directory (`usage: uv run apps/grpo`
was printed whichever ran)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_app import evaluate, export, main
from grpo_app.preflight import model_dir_problem

APP = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_the_console_script_the_trainer_recognises():
    scripts = tomllib.loads((APP / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"grpo": "grpo_app.main:main"}


@pytest.mark.parametrize(("argv0", "prog"), [("/opt/venv/bin/grpo", "grpo"), (str(APP), "uv run apps/grpo"),
                                             ("apps/grpo", "uv run apps/grpo")])
def test_usage_lines_and_hints_name_the_command_that_ran(monkeypatch, capsys, tmp_path, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    for parse, usage in ((main.parse_args, prog), (export.parse_args, f"{prog} export"),
                         (evaluate.parse_args, f"{prog} eval")):
        with pytest.raises(SystemExit):
            parse(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: {usage} [-h]")
    with pytest.raises(SystemExit):
        main.parse_args(["--help"])
    assert f"\n  {prog} grpo.max_steps=5\n  {prog} --config gpu_1x" in capsys.readouterr().out  # the examples
    with pytest.raises(SystemExit):
        main.parse_args(["--config", "x", "eval"])
    assert f"'eval' is a subcommand and comes first: {prog} eval [its options]" in capsys.readouterr().err
    (tmp_path / "checkpoints/step_1/policy").mkdir(parents=True)
    assert f"write one with `{prog} export {tmp_path}`" in model_dir_problem(str(tmp_path))


def test_the_installed_script_and_the_directory_print_their_own_usage():
    """The real processes: the console script uv installed beside this interpreter, and the directory as uv runs it."""
    for command, usage in (([str(Path(sys.executable).parent / "grpo")], "usage: grpo [-h]"),
                           ([sys.executable, "apps/grpo"], "usage: uv run apps/grpo [-h]")):
        proc = subprocess.run([*command, "--help"], cwd=APP.parents[1], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout.startswith(usage), proc.stdout[:500] + proc.stderr[-2000:]
