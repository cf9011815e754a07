"""`uv run apps/grpo`: the GRPO trainer (the command line: grpo_app/cli.py; the run: grpo_app/main.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # grpo_app, also when run from a checkout

from grpo_app.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
