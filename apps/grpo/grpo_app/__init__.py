"""grpo_app: the GRPO trainer (see main.py).

Ray reads RAY_ENABLE_UV_RUN_RUNTIME_ENV when it is imported: under `uv run` it would otherwise rebuild the
whole workspace into a fresh venv for its workers (minutes at startup); the driver's venv is already the
right one for every worker on this machine. Set here, before any module of this package imports ray.
"""

import os

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
