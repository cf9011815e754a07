"""Both engines join torchrun's process group: 2 ranks under torchrun make the same update as 1 rank.

Before, the DTensor engine started a private 1-rank group under torchrun (two unsynchronised copies) and
the Megatron engine hung. Each engine trains one step on the same global batch: 2 DP ranks launched by
`python -m torch.distributed.run --nproc_per_node 2` (gloo), against one rank forked in this process.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import cached_tiny_checkpoint

SCRIPT = Path(__file__).with_name("engine_step.py")
VOCAB = 128


def _load_step_module():
    spec = importlib.util.spec_from_file_location("engine_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_rank(rank: int, world_size: int, engine: str, ckpt: str) -> dict:
    return _load_step_module().train_one_step(engine, ckpt, VOCAB)


@pytest.mark.slow  # a fresh torchrun launch imports torch, transformers (and megatron) on each rank
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_torchrun_two_ranks_equal_one_rank(tmp_path, engine):
    pytest.importorskip(f"engine_{engine}")
    ckpt = str(cached_tiny_checkpoint("qwen2"))
    out = tmp_path / "two_ranks.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # --standalone: torchrun's store listens on a port its OS picks as it binds, and the workers join that store (a
    # port found free here and passed as --master_port can be taken before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT), engine,
           ckpt, str(out), str(VOCAB)]
    proc = subprocess.Popen(cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=400)
    finally:  # a hung run: stop the launcher and its workers (one session), not only the launcher
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-6000:]
    two = torch.load(out, weights_only=False)
    (one,) = run_distributed(_one_rank, world_size=1, args=(engine, ckpt))
    assert (two["world_size"], two["dp_size"], one["dp_size"]) == (2, 2, 1)
    assert abs(two["loss"] - one["loss"]) <= 1e-6, (two["loss"], one["loss"])
    assert two["weights"].keys() == one["weights"].keys()
    initial = dict(_initial_weights(ckpt))
    moved = max(float((one["weights"][n] - initial[n]).abs().max()) for n in initial)
    diff = max(float((two["weights"][n] - one["weights"][n]).abs().max()) for n in one["weights"])
    assert moved > 1e-4 and diff <= 1e-6, (moved, diff)  # the step did train, and identically


def _initial_weights(ckpt: str):
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model.safetensors")).items()
