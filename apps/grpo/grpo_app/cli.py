"""The command line: `uv run apps/grpo [--config FILE] [dotted.key=value ...]`, and its subcommands.

Parsed before the trainer is imported (grpo_app.main: torch and Ray, ~1.5 s on import), so that `--help` and a
mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from grpo_app import program_name

# `uv run apps/grpo NAME ...`: the module whose main(argv) runs it
SUBCOMMANDS = {"export": "grpo_app.export", "eval": "grpo_app.evaluate"}


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
    parser.add_argument("--config", help="YAML config file, or the name of a shipped one (e.g. gpu_1x; default: cpu_default)")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="Python logging level")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. grpo.max_steps=5")
    # `apps/grpo --config X eval --samples 2`: main dispatches on argv[0] only, and the subcommand's options would be
    # refused as unknown here first
    for name in sorted(SUBCOMMANDS.keys() & set(sys.argv[1:] if argv is None else argv)):
        parser.error(f"'{name}' is a subcommand and comes first: {prog} {name} [its options] (see {name} -h)")
    return parser.parse_intermixed_args(argv)  # overrides may come before and after --config


def main(argv: list[str] | None = None) -> int:
    """The whole command (the `grpo` console script, `uv run apps/grpo`); its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:  # no override can be one (overrides contain '=')
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    args = parse_args(argv)
    from grpo_app.main import run

    return run(args)
