"""Peak host memory per rank of the DTensor engine's model initialisation: meta device + streamed shards vs
the old eager path (from_pretrained on every rank, then shard), on a multi-shard checkpoint, CPU, 2 ranks.

    uv run python packages/engine-dtensor/bench/bench_meta_init.py [--layers 48] [--shards 8] [--world 2]

Builds a Qwen2-shaped bf16 checkpoint (hidden 1024, 48 layers, vocab 32000: ~608M parameters, ~1.2 GB, bf16
as released checkpoints are) saved in `--shards` safetensors files, once, under --dir; the engine keeps fp32
master weights, so a rank's shard of the model is 2 bytes x parameters / ranks. Then, for each path, starts `--world` fresh rank
processes (gloo) that import everything, record their RSS (the baseline), build the sharded model, and
report VmHWM (peak RSS, file-backed pages of the mmapped safetensors included) minus the baseline. The
target for the streamed path is 1.2 x the largest shard + this rank's share of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, sys
import torch, torch.distributed as dist
import transformers  # noqa: F401  (imported before the baseline)
from transformers import AutoModelForCausalLM
from engine_dtensor.config import DTensorConfig
from engine_dtensor.loading import build_meta_model, materialize
from engine_dtensor.parallel_dims import ParallelDims
from engine_dtensor.parallelize import parallelize
from rl_core.config import PolicyConfig

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

mode, path = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo")
dims = ParallelDims.from_world(dist.get_world_size(), 1)
dims.build_mesh("cpu")
cfg = DTensorConfig.from_policy(PolicyConfig(model_name=path))
dist.barrier()
base = rss_kib("VmRSS:")
if mode == "streamed":
    model = build_meta_model(path, "sdpa")
    parallelize(model, dims, cfg)
    materialize(model, path, torch.device("cpu"))
else:  # the old path: the whole fp32 model on every rank, then shard
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    parallelize(model, dims, cfg)
local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
dist.barrier()
print(json.dumps({"rank": dist.get_rank(), "baseline_kib": base, "peak_kib": rss_kib("VmHWM:"),
                  "local_param_bytes": local}))
dist.destroy_process_group()
"""


def build_checkpoint(out: Path, layers: int, shards: int) -> Path:
    """A Qwen2-shaped bf16 checkpoint with random weights in `shards` files (built once)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (out / "model.safetensors.index.json").exists():
        return out
    config = Qwen2Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # save_pretrained starts a new file before a tensor would exceed the limit: aim a bit above total/shards
    model.save_pretrained(out, max_shard_size=int(total / shards * 1.02))
    return out


def run_ranks(mode: str, path: Path, world: int) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, mode, str(path)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{mode} rank failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/rl-stack-bench/meta-init")
    args = parser.parse_args()
    path = build_checkpoint(Path(args.dir) / f"qwen2-{args.layers}l-{args.shards}s", args.layers, args.shards)
    files = sorted(path.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files)
    total = sum(f.stat().st_size for f in files)
    mib = 1 << 20
    print(f"checkpoint: {len(files)} shards, {total / mib:.0f} MiB, largest shard {largest / mib:.0f} MiB")
    print("| path | rank | peak - baseline (MiB) | rank's shard of the model (MiB) | target (MiB) | ratio to target |")
    print("|---|---|---|---|---|---|")
    for mode in ("streamed", "eager"):
        for r in run_ranks(mode, path, args.world):
            delta = (r["peak_kib"] - r["baseline_kib"]) * 1024
            target = 1.2 * largest + r["local_param_bytes"]
            print(f"| {mode} | {r['rank']} | {delta / mib:.0f} | {r['local_param_bytes'] / mib:.0f} | "
                  f"{target / mib:.0f} | {delta / target:.2f} |")


if __name__ == "__main__":
    main()
