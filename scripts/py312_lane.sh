#!/usr/bin/env bash
# The python 3.12 / megatron-core 0.19 lane, in .venv-py312: the quick suites (-m "not slow") of what depends
# on megatron-core (engine-megatron, ckpt-convert, the torchrun/plug-in engine tests, the trainer's megatron
# export run) and of the pure-python cores (rl-core, seqpack).
#
# Why: on python >= 3.12 uv.lock resolves megatron-core 0.19 (0.16 on 3.11, the default .venv), and
# megatron-core changes private and public APIs between them. The rest resolves to the same versions on both
# pythons (torch, transformers, ray) or a minor version apart (numpy 2.4 vs 2.3, networkx, contourpy), so lane 1
# covers it; running every quick suite twice took ~18 of the 2-core CI's 45 minutes. The venv (.venv-py312, gitignored) is
# synced from the same lock; uv only uses a python 3.12 that is already installed (never downloads).
# Python: $PY312, else a working `python3.12` on PATH, `uv python find 3.12`, or pyenv's 3.12.
# Usage: bash scripts/py312_lane.sh [extra pytest args]
#        bash scripts/py312_lane.sh --prepare   (sync the venv only; scripts/test.sh runs it beside lane 1)
set -euo pipefail
cd "$(dirname "$0")/.."

works() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }

PY="${PY312:-}"
works "$PY" || PY="$(command -v python3.12 || true)"
works "$PY" || PY="$(UV_PYTHON_DOWNLOADS=never uv python find 3.12 2>/dev/null || true)"
works "$PY" || PY="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null | tail -n 1 || true)"
if ! works "$PY"; then
  echo "py312 lane: no working python 3.12 found (tried \$PY312, python3.12 on PATH, 'uv python find 3.12'," \
       "pyenv versions). Install python 3.12 or set PY312=/path/to/python3.12." >&2
  exit 1
fi
echo "py312 lane: $PY -> .venv-py312 (megatron-core from uv.lock for python 3.12)" >&2
export UV_PROJECT_ENVIRONMENT=.venv-py312 UV_PYTHON_DOWNLOADS=never
uv sync --locked --python "$PY" --quiet
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
.venv-py312/bin/python -m pytest -m "not slow and not vllm and not gpu" -n 2 --dist loadfile \
  packages/engine-megatron packages/ckpt-convert packages/rl-core packages/seqpack tests/engines \
  "apps/grpo/tests/test_export.py::test_export_of_a_run_is_the_checkpointed_policy[megatron]" "$@"
