"""Every file path the documentation names exists (a renamed config or script leaves no dead command behind)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a repository path such as apps/grpo/grpo_app/configs/gpu_1x.yaml or scripts/test.sh, not part of a longer path or URL
PATH = re.compile(r"(?<![\w./-])((?:apps|packages|bench|scripts|tests|\.ci)/[\w./-]+\.(?:yaml|py|sh|md|toml))")


def _docs() -> list[Path]:
    docs = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "runs"]  # venvs, .git, outputs
        docs += [Path(folder) / f for f in files if f.endswith(".md")]
    return docs


def test_paths_named_in_docs_exist() -> None:
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in _docs() for path in PATH.findall(doc.read_text())
               if not (ROOT / path).exists() and not (doc.parent / path).exists()]
    assert len(_docs()) > 5
    assert not missing, "documentation names files that do not exist:\n" + "\n".join(missing)


# ---- commands the documentation shows: their flags, config names and keys exist ----------------------------

# `apps/grpo ARGS`, `bench/x.py ARGS`, `ckpt-convert SUB ARGS` up to the end of the code span or a comment
TRAINER = re.compile(r"(?:uv run|python) apps/grpo((?: +(?!#)[^\s`|#]+)*)")
SCRIPT = re.compile(r"(?<![\w./-])((?:bench|packages/[\w-]+/bench)/\w+\.py)((?: +(?!#)[^\s`|#]+)*)")
CONVERTER = re.compile(r"ckpt-convert (hf2mcore|mcore2hf)((?: +(?!#)[^\s`|#]+)*)")


def _commands(pattern: re.Pattern[str]) -> list[tuple[Path, str, tuple[str, ...]]]:
    """(doc, where, match groups) of every occurrence in the docs."""
    found = []
    for doc in _docs():
        for lineno, line in enumerate(doc.read_text().splitlines(), start=1):
            for match in pattern.finditer(line):
                found.append((doc, f"{doc.relative_to(ROOT)}:{lineno}", match.groups()))
    return found


def _args(text: str) -> list[str]:
    """The words of a command, placeholders ([...], <...>, ...) left out."""
    words = [a.strip("'\"") for a in text.split()]
    return [a for a in words if not a.startswith(("[", "<", "...")) and not a.endswith(("]", ">"))]


def test_trainer_command_lines_in_docs_load():
    """Every `apps/grpo [--config X] key=value ...` the docs show names a config that exists and keys that
    validate (loading only: no model, no Ray)."""
    from grpo_app.cli import SUBCOMMANDS
    from grpo_app.config import load_config
    from grpo_app.devices import Hardware

    gpu = Hardware(cuda_available=True, bf16_supported=True, num_gpus=8)
    failures, count = [], 0
    for _, where, (rest,) in _commands(TRAINER):
        args = _args(rest)
        if args[:1] == ["export"]:  # a checkpoint path and flags, no config keys
            continue
        config = None
        if "--config" in args[:-1]:
            i = args.index("--config")
            config, args = args[i + 1], args[:i] + args[i + 2:]
        if args[:1] and args[0] in SUBCOMMANDS and config and config.startswith("runs/"):
            config = None  # eval --config <a run's config.yaml>: an output; the keys still load on the default
        overrides = [a for a in args if "=" in a]
        count += 1
        try:
            load_config(ROOT / config if config and (ROOT / config).is_file() else config, overrides, hardware=gpu)
        except Exception as exc:  # noqa: BLE001 (any failure is the doc's)
            failures.append(f"{where}: apps/grpo{rest}: {exc}")
    assert count >= 10
    assert not failures, "\n".join(failures)


def test_script_flags_in_docs_exist():
    """Every `--flag` the docs pass to a bench script is one of its argparse options."""
    missing, count = [], 0
    for doc, where, (script, rest) in _commands(SCRIPT):
        source = (ROOT / script if (ROOT / script).is_file() else doc.parent / script).read_text()
        for flag in (a for a in _args(rest) if a.startswith("--")):
            count += 1
            if f'"{flag}"' not in source:
                missing.append(f"{where}: {script} has no option {flag}")
    assert count >= 10
    assert not missing, "\n".join(missing)


def test_ckpt_convert_command_lines_in_docs_parse():
    from ckpt_convert.cli import build_parser

    failures = []
    for _, where, (command, rest) in _commands(CONVERTER):
        if not rest:  # the subcommand named in prose
            continue
        try:
            build_parser().parse_args([command, *_args(rest)])
        except SystemExit:
            failures.append(f"{where}: ckpt-convert {command}{rest}")
    assert len(_commands(CONVERTER)) >= 4
    assert not failures, "these documented ckpt-convert commands do not parse:\n" + "\n".join(failures)
