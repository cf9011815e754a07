"""grpo_app: the GRPO trainer (see main.py).

Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV when it is imported: under `uv run` it would otherwise rebuild the
whole workspace into a fresh venv for its workers (minutes at startup); the driver's venv is already the
right one for every worker on this machine. Set here, before any module of this package imports ray.
"""

import os
import time

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

STARTED = time.monotonic()  # the command's start, near enough (its first import): checkpointing.must_save_by counts from it

# the console script the grpo-app wheel installs (pyproject.toml [project.scripts]; tests/test_wheels.py checks it)
CONSOLE_SCRIPT = "grpo"


def program_name() -> str:
    """The command that started the trainer, for its usage lines and the commands its messages suggest: `grpo` when
    the installed console script was run, else `uv run apps/grpo` (the apps/grpo directory, as the docs run it; also
    a test or a script that calls main() itself)."""
    import sys
    from pathlib import Path

    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.name == CONSOLE_SCRIPT and not script.is_dir():  # apps/grpo is a `grpo` too
        return CONSOLE_SCRIPT
    return "uv run apps/grpo"
