"""The command line: `uv run apps/grpo [--config FILE] [dotted.key=value ...]`, and its subcommands `export` and `eval`.

Every command's options are parsed here, before the module that runs it is imported (grpo_app.main, export and
evaluate: torch, and Ray for the trainer, ~1.5 s on import), so that `-h` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from grpo_app import program_name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    prog = program_name()
    parser = argparse.ArgumentParser(
        prog=prog, description="GRPO trainer: train a Hugging Face causal LM with GRPO on a reward environment.",
        epilog=f"examples:\n  {prog} grpo.max_steps=5\n"
               f"  {prog} --config gpu_1x policy.megatron_cfg.enabled=true\n"
               f"  {prog} export RUN_DIR [--out DIR]   (a checkpoint as a Hugging Face model; export -h)\n"
               f"  {prog} eval --config RUN_DIR/config.yaml policy.model_name=MODEL_DIR [--samples K]\n"
               "      (mean reward and pass@k on the validation prompts; eval -h)\n"
               "every key and its default: apps/grpo/README.md", formatter_class=argparse.RawDescriptionHelpFormatter)
    options = [parser.add_argument("--config", help="YAML config file, or the name of a shipped one (e.g. gpu_1x; "
                                                    "default: cpu_default)"),
               add_log_level(parser)]
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. grpo.max_steps=5")
    argv = sys.argv[1:] if argv is None else argv
    # `apps/grpo --config X eval --samples 2`: main dispatches on argv[0] only, and the subcommand's options would be
    # refused as unknown here first
    for name in sorted(SUBCOMMANDS.keys() & set(argv)):
        parser.error(f"'{name}' is a subcommand and comes first: {prog} {name} [its options] (see {name} -h)")
    own = {"-h", "--help"} | {string for action in options for string in action.option_strings}
    if not {"-h", "--help"} & set(argv) and (foreign := dashed_settings(argv, own)):  # help first
        known, _ = parser.parse_known_intermixed_args(argv)  # the --config and overrides given with them
        parser.error(explain_dashed_settings(foreign, known.config, [o for o in known.overrides if "=" in o]))
    return parser.parse_intermixed_args(argv)  # overrides may come before and after --config


def add_log_level(parser: argparse.ArgumentParser) -> argparse.Action:
    return parser.add_argument("--log-level", default="INFO", type=str.upper,
                               choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="Python logging level")


def parse_export_args(argv: list[str]) -> argparse.Namespace:
    """`export`'s options (grpo_app.export.run)."""
    parser = argparse.ArgumentParser(prog=f"{program_name()} export", description="Write a run checkpoint as a "
                                     "Hugging Face model directory (offline, either engine).")
    parser.add_argument("path", help="a run directory (its newest intact checkpoint) or one checkpoint (step_N)")
    parser.add_argument("--out", metavar="DIR", help="the new model directory (must not exist; default: "
                                                     "<log_dir>/hf/step_N, <log_dir> being the directory of the run's "
                                                     "config.yaml)")
    parser.add_argument("--config", metavar="FILE", help="the run's resolved config.yaml, if it is not beside the "
                                                         "checkpoints (<log_dir>/config.yaml; needed when "
                                                         "checkpointing.dir was elsewhere)")
    parser.add_argument("--base-model", metavar="DIR", help="the run's base model (policy.model_name) where it is now, "
                                                            "if it has moved (a LoRA checkpoint holds the adapters "
                                                            "alone; the base must hold the weights the run trained on)")
    return parser.parse_args(argv)


def parse_eval_args(argv: list[str]) -> argparse.Namespace:
    """`eval`'s options (grpo_app.evaluate.run)."""
    parser = argparse.ArgumentParser(prog=f"{program_name()} eval", description="A model's score on the task's "
                                     "validation prompts (mean reward, accuracy, pass@k).",
                                     epilog=f"example:\n  {program_name()} eval --config runs/x/config.yaml "
                                            "policy.model_name=runs/x/checkpoints/step_100/hf --samples 8",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (a run's config.yaml) or a shipped one's name")
    parser.add_argument("--samples", type=_positive, default=1,
                        help="completions per prompt: 1 (default) is greedy; K > 1 samples and reports pass@k")
    parser.add_argument("--threshold", type=float, default=1.0,
                        help="a completion counts as solved when the environment says it is correct or, where it only "
                             "gives a reward, when the reward is >= this (default 1.0)")
    parser.add_argument("--out", type=Path, help="where the completions go (JSONL; default: "
                                                 "<logger.log_dir>/eval/<model>[-samplesK].jsonl, see "
                                                 "grpo_app.evaluate.default_out)")
    add_log_level(parser)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. policy.model_name=DIR")
    return parser.parse_intermixed_args(argv)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


# `uv run apps/grpo NAME ...`: NAME's options, and the module whose run(args) runs it
SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], argparse.Namespace], str]] = {
    "export": (parse_export_args, "grpo_app.export"), "eval": (parse_eval_args, "grpo_app.evaluate")}


def dashed_settings(argv: list[str], own: set[str]) -> dict[str, str]:
    """The `--name value`, `--name=value` and bare `--flag` (true) of `argv` that are not options of this command,
    nor abbreviations of one (argparse takes them) or misspellings (argparse refuses them): name -> value as written."""
    found = {}
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if not arg.startswith("--") or arg == "--" or any(option.startswith(name) for option in own) \
                or difflib.get_close_matches(name, own, n=1, cutoff=0.8):
            continue
        if not equals:
            follows = argv[i + 1] if i + 1 < len(argv) else ""
            value = follows if follows and not follows.startswith("--") and "=" not in follows else "true"
        found[name[2:]] = value
    return found


def explain_dashed_settings(settings: dict[str, str], config: str | None, overrides: list[str]) -> str:
    """What `--name value` settings are here, read as the overrides `name=value` (after `config` and `overrides`):
    TRL's flags (`trl grpo --learning_rate 1e-6`) get the whole port (grpo_app.ported_configs), this config's keys the
    overrides to write."""
    from grpo_app.config import load_config
    from rl_core.config import ConfigError

    flags = ", ".join(f"--{name}" for name in settings)
    rewritten = [f"{name}={value}" for name, value in settings.items()]
    intro = (f"{flags}: {'not options' if len(settings) > 1 else 'not an option'} of this command; every setting "
             "here is a dotted key=value override, without dashes")
    try:
        load_config(config, overrides + rewritten)
    except (ConfigError, OSError) as exc:
        return f"{intro}. Read as overrides ({' '.join(rewritten)}): {exc}"
    return f"{intro}: {' '.join(rewritten)}"


def main(argv: list[str] | None = None) -> int:
    """The whole command (the `grpo` console script, `uv run apps/grpo`); its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:  # no override can be one (overrides contain '=')
        parse, module = SUBCOMMANDS[argv[0]]
        args = parse(argv[1:])  # before the import: `-h` and a bad option answer at once
        return importlib.import_module(module).run(args)
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # grpo_app.config imports no torch, no Ray: a config error answers before they are imported
    from grpo_app.config import load_config
    from rl_core.config import ConfigError

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        logging.getLogger("grpo").error("%s", exc)
        return 2
    from grpo_app.main import run

    return run(cfg)
