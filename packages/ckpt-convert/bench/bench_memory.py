"""Peak memory of hf2mcore / mcore2hf on a synthetic ~1 GB multi-shard Llama checkpoint.

    uv run python packages/ckpt-convert/bench/bench_memory.py [--gb 1.0] [--shard-mb 256]

Builds the checkpoint shard by shard (random weights, a Llama config with hidden size 2048) in a temp dir,
then runs each conversion in a fresh subprocess and reports that process's peak RSS (VmHWM) minus its
RSS after imports (torch + megatron + transformers, which every conversion pays), against the largest
input shard. Target: peak - baseline <= 1.5 x largest shard. (Not ru_maxrss: Linux carries it across exec, so
a child reports the peak of the parent that built the checkpoint.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CHILD = r"""
import json, sys, time, psutil
from ckpt_convert.convert import convert_hf_to_mcore, convert_mcore_to_hf
import megatron.core, transformers  # noqa: F401  (imported before the baseline)
base = psutil.Process().memory_info().rss
def high_water_mark():  # VmHWM: peak RSS of this process image, reset at exec
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
peak_before = high_water_mark()
t0 = time.perf_counter()
if sys.argv[1] == "hf2mcore":
    convert_hf_to_mcore(sys.argv[2], sys.argv[3])
else:
    convert_mcore_to_hf(sys.argv[2], sys.argv[3], max_shard_bytes=int(sys.argv[4]))
print(json.dumps({"baseline": base, "peak_before": peak_before, "seconds": time.perf_counter() - t0,
                  "peak": high_water_mark()}))
"""


def llama_config(layers: int) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=5632,
                num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, vocab_size=16000,
                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                rope_theta=10000.0, torch_dtype="float32")


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def build_checkpoint(path: Path, gb: float, shard_bytes: int) -> int:
    """Write the synthetic checkpoint one shard at a time; returns the largest shard size in bytes."""
    from safetensors.torch import save_file

    per_layer = 4 * (2 * 2048 * 2048 + 2 * 1024 * 2048 + 3 * 2048 * 5632)
    layers = max(1, round((gb * 2**30 - 2 * 4 * 16000 * 2048) / per_layer))
    cfg = llama_config(layers)
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    shards: list[dict] = [{}]
    size = 0
    for name, shape in tensor_shapes(cfg):
        nbytes = 4 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    weight_map, total = {}, 0
    gen = torch.Generator().manual_seed(0)
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: torch.randn(s, generator=gen) * 0.02 for n, s in names.items()}
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    print(f"synthetic checkpoint: {layers} layers, {total / 2**30:.2f} GiB in {len(shards)} shards")
    return max(f.stat().st_size for f in path.glob("*.safetensors"))


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--shard-mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        largest = build_checkpoint(root / "hf", args.gb, args.shard_mb * 2**20)
        print(f"largest shard: {largest / 2**20:.0f} MiB")
        for direction, src, dst, extra in (("hf2mcore", "hf", "mcore", []),
                                           ("mcore2hf", "mcore", "hf-back", [str(largest)])):
            r = run_child(direction, str(root / src), str(root / dst), *extra)
            delta = r["peak"] - r["baseline"]
            print(f"{direction}: {r['seconds']:.1f} s; peak RSS {r['peak'] / 2**20:.0f} MiB, after imports "
                  f"{r['baseline'] / 2**20:.0f} MiB -> conversion added {delta / 2**20:.0f} MiB = "
                  f"{delta / largest:.2f} x largest shard (target <= 1.5)")


if __name__ == "__main__":
    main()
