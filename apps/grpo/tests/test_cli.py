"""The command line (grpo_app.cli): overrides around --config, settings given as --options, and the usage lines and
the commands its messages suggest, which name the command that was run: `grpo`, the console script the grpo-app wheel
installs, or `uv run apps/grpo`, the apps/grpo directory (`usage: uv run apps/grpo` was printed whichever ran)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_app import cli
from grpo_app.preflight import model_dir_problem

APP = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_the_console_script_the_trainer_recognises():
    scripts = tomllib.loads((APP / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"grpo": "grpo_app.cli:main"}


@pytest.mark.parametrize(("argv0", "prog"), [("/opt/venv/bin/grpo", "grpo"), (str(APP), "uv run apps/grpo"),
                                             ("apps/grpo", "uv run apps/grpo")])
def test_usage_lines_and_hints_name_the_command_that_ran(monkeypatch, capsys, tmp_path, argv0, prog):
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    for parse, usage in ((cli.parse_args, prog), (cli.parse_export_args, f"{prog} export"),
                         (cli.parse_eval_args, f"{prog} eval")):
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
    `--help`, a subcommand's `-h`, a mistyped option and a mistyped config key answer before the trainer's imports
    (torch and Ray: ~1.5 s, a third of `uv run apps/grpo --help`; `export -h` took 1.3 s, a config typo 2.2 s);
    Python's own import log (PYTHONPROFILEIMPORTTIME) says which modules were imported."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    for command, prog in (([str(Path(sys.executable).parent / "grpo")], "grpo"),
                          ([sys.executable, "apps/grpo"], "uv run apps/grpo")):
        for args, code, stream, usage in ((["--help"], 0, "stdout", f"usage: {prog} [-h]"),
                                          (["--log-levl", "debug"], 2, "stderr", f"usage: {prog} [-h]"),
                                          (["export", "-h"], 0, "stdout", f"usage: {prog} export [-h]"),
                                          (["eval", "--samples", "0"], 2, "stderr", f"usage: {prog} eval [-h]"),
                                          (["grpo.max_stepz=5"], 2, "stderr", "unknown config key 'grpo.max_stepz'")):
            proc = subprocess.run([*command, *args], cwd=APP.parents[1], env=env, capture_output=True, text=True,
                                  timeout=300)
            log = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
            out = proc.stdout if stream == "stdout" else proc.stderr.replace("\n".join(log), "")
            assert proc.returncode == code and usage in out, proc.stdout[:500] + proc.stderr[-2000:]
            imported = {line.rsplit("|", 1)[-1].strip() for line in log}
            assert "grpo_app.cli" in imported and not imported & {"torch", "ray", "grpo_app.main"}, (args, command)


def test_command_line_takes_overrides_around_config_and_checks_the_log_level(capsys):
    from grpo_app.cli import parse_args

    args = parse_args(["grpo.max_steps=1", "--config", "gpu_1x", "grpo.seed=3", "--log-level", "debug"])
    assert (args.config, args.overrides, args.log_level) == ("gpu_1x", ["grpo.max_steps=1", "grpo.seed=3"], "DEBUG")
    with pytest.raises(SystemExit) as exit_info:  # argparse's one-line usage error, not a logging traceback
        parse_args(["--log-level", "verbose"])
    assert exit_info.value.code == 2 and "invalid choice: 'VERBOSE'" in capsys.readouterr().err


def test_settings_given_as_dashed_options_say_what_to_write(capsys):
    """`--learning_rate 1e-6` (TRL's `trl grpo` flags) and `--grpo.max_steps 5` were "unrecognized arguments" and no
    more: the first gets TRL's port, the second the overrides to write instead."""
    from grpo_app.cli import parse_args

    def error_of(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
        return capsys.readouterr().err.splitlines()[-2:]

    first, second = error_of(["--model_name_or_path", "m", "--learning_rate", "1e-6", "--num_generations=8", "--bf16"])
    assert first.startswith("uv run apps/grpo: error: --model_name_or_path, --learning_rate, --num_generations, --bf16: "
                            "not options of this command; every setting here is a dotted key=value override, without "
                            "dashes. Read as overrides (model_name_or_path=m learning_rate=1e-6 num_generations=8 "
                            "bf16=true): unknown config key 'model_name_or_path'")
    assert first.endswith("This config uses TRL's names; here they are spelled: model_name_or_path -> policy.model_name, "
                          "learning_rate -> policy.optimizer.kwargs.lr, num_generations -> grpo.num_generations_per_prompt")
    assert second == "set otherwise here: bf16=true -> policy.precision=bfloat16"
    *_, ours = error_of(["grpo.seed=3", "--grpo.max_steps", "5", "--config", "cpu_default", "--loss.kl_coef=0.1"])
    assert ours.endswith("--grpo.max_steps, --loss.kl_coef: not options of this command; every setting here is a dotted "
                         "key=value override, without dashes: grpo.max_steps=5 loss.kl_coef=0.1")
    *_, typo = error_of(["--grpo.max_stepz", "5"])  # read as the override, it gets the override's own error
    assert "Read as overrides (grpo.max_stepz=5): unknown config key 'grpo.max_stepz'; did you mean 'grpo.max_steps'?" in typo
    assert parse_args(["--conf", "gpu_1x", "--log-level=debug"]).config == "gpu_1x"  # argparse's abbreviations stay
    with pytest.raises(SystemExit) as exit_info:  # asking for help gets it
        parse_args(["--learning_rate", "1e-6", "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: ")
