"""Both engines on one GPU: Qwen2.5-0.5B shape and an 8-layer x 2048 model, a 128-sequence GRPO batch,
bf16, packed and unpacked (issue 13's targets).

    uv run bench/gpu_engines.py [--device cuda] [--mb-tokens 8192] [--repeats 3] [--models 0.5b,8x2048]
    uv run bench/gpu_engines.py --device cpu --tiny     # the same code path, small, to show it runs

Models (random init std 0.02, built locally and cached under ~/.cache/rl-stack/bench-models): Qwen2.5-0.5B
(hidden 896, 24 layers, 14/2 heads, SwiGLU 4864, vocab 151936, tied embeddings) and 8 layers x hidden 2048
(16/2 heads, SwiGLU 11008, vocab 151936). Batch: 128 sequences of lognormal lengths (median 512, max 2048),
loss on the second half of each. Layouts: packed (sequence packing, --mb-tokens per micro-batch) and
unpacked (dynamic batching, padded rows, the same token budget). Engines: dtensor, megatron, and
dtensor-compile (`policy.dtensor_cfg.compile`: torch.compile per decoder layer, fusing the RMSNorm, RoPE,
SwiGLU and residual elementwise passes that HF's eager layers run one kernel each), dtensor-lora and
megatron-lora
(`policy.<engine>_cfg.lora_cfg`, rank 16 on every decoder linear layer: the peak memory is the point; its MFU
counts the FLOPs of full training, which LoRA does not spend on the frozen weights' gradients).

Each (model, engine, layout) runs in a fresh process (spawned: CUDA) so peaks and first calls are its own.
Reported per run: the process's first `train_batch` (one-time costs: allocator growth, kernel loading,
optimizer state; on other lengths), then the measured batch's first call (new lengths, as every GRPO step
brings: per-shape kernel planning; issue 13's target is new / warm <= 1.3), warm time (median of
--repeats more calls on the same batch), tokens/s warm, MFU = model FLOPs / warm time / the bf16 GEMM
rate measured in the same process (FLOPs by bench/mfu.model_flops: 6 N T + 12 L d sum len^2), peak GPU
memory (torch.cuda.max_memory_allocated), loss and grad norm of the process's first call (the same
weights and batch for every engine and layout, so comparable; later calls follow each engine's optimizer
steps: after two AdamW steps at lr 1e-5 the first GPU run showed dtensor -0.108 / 0.79 and megatron
-0.027 / 1.06).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from pathlib import Path

import torch
from _common import CACHE, long_tail_lengths, make_batch, markdown_table, policy_config, setup_logging

logger = logging.getLogger("bench.gpu_engines")

QWEN_VOCAB = 151936
MODELS = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=True),
    "8x2048": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=2, vocab_size=QWEN_VOCAB, tie_word_embeddings=False),
}
# --tiny: the same architectures scaled down so the whole matrix runs on a CPU in minutes
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=QWEN_VOCAB)


def build_model(name: str, shape: dict) -> Path:
    """A Qwen2 checkpoint of `shape` with HF's random init (std = initializer_range = 0.02), cached."""
    path = CACHE / "bench-models" / f"qwen2-{name}"
    if (path / "config.json").exists():
        return path
    import transformers

    from rl_core.testing.tiny_models import build_tokenizer

    logger.info("building %s at %s", name, path)
    config = transformers.Qwen2Config(**shape, max_position_embeddings=32768, rms_norm_eps=1e-6,
                                      rope_theta=1000000.0, initializer_range=0.02, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    tmp.rename(path)
    return path


def gemm_rate(device: str, dtype: torch.dtype, n: int = 8192, repeats: int = 10) -> float:
    """Measured FLOP/s of an n^3 matmul in `dtype` on `device` (median after a warm-up)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(device: str, fn) -> tuple[float, dict]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _rank_fn(rank: int, world: int, model: str, engine_name: str, packed: bool, lengths: list[int],
             warmup_lengths: list[int], mb_tokens: int, repeats: int, device: str, gemm_n: int,
             profile_top: int) -> dict:
    from mfu import model_flops, profile_pass
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine

    rate = gemm_rate(device, torch.bfloat16, n=gemm_n)
    megatron = engine_name.startswith("megatron")
    lora = {"lora_cfg": {"enabled": True, "dim": 16}}
    extra = {"dtensor-compile": {"dtensor_cfg": {"compile": True}}, "dtensor-lora": {"dtensor_cfg": lora},
             "megatron-lora": {"megatron_cfg": {"enabled": True, **lora}}}.get(engine_name, {})
    policy = policy_config(model, packing=packed, mb_tokens=mb_tokens, megatron=megatron, precision="bfloat16",
                           **extra)
    engine = create_engine(policy)
    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        flops, _ = model_flops(AutoModelForCausalLM.from_config(config), lengths)
    loss = ClippedPGLoss()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # 1. the process's first step (one-time costs) on other lengths; its loss and grad norm are comparable
    #    across engines and layouts: same weights, same batch, prev logprobs from the engine itself
    warmup = make_batch(warmup_lengths, config.vocab_size, seed=1)
    warmup = warmup.with_fields(prev_logprobs=engine.compute_logprobs(warmup))
    first, metrics = _timed(device, lambda: engine.train_batch(warmup, loss))
    # 2. new lengths, as every GRPO step brings (no logprob pass first: it would plan the forward's shapes)
    batch = make_batch(lengths, config.vocab_size, seed=0)
    uniform = math.log(config.vocab_size)  # a std-0.02 model's logprobs are ~ -log V: ratios near 1
    batch = batch.with_fields(prev_logprobs=[torch.full((n,), -uniform) for n in lengths])
    new, _ = _timed(device, lambda: engine.train_batch(batch, loss))
    # 3. the same lengths again
    warm_s = statistics.median(_timed(device, lambda: engine.train_batch(batch, loss))[0] for _ in range(repeats))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    profiled = profile_pass(engine, batch, loss, profile_top, device) if profile_top else None
    return {"first_s": first, "new_s": new, "warm_s": warm_s, "tokens_per_s": sum(lengths) / warm_s,
            "mfu": flops / warm_s / rate, "gemm_tflops": rate / 1e12, "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"], "peak_gib": peak, "profile": profiled}


def measure(model: Path, engine: str, packed: bool, lengths: list[int], warmup_lengths: list[int],
            args: argparse.Namespace) -> dict:
    from rl_core.testing.distributed import CUDA_BACKEND, run_distributed

    backend = CUDA_BACKEND if args.device == "cuda" else "gloo"
    return run_distributed(_rank_fn, world_size=1, timeout=1800.0, backend=backend,
                           start_method="spawn" if args.device == "cuda" else None,
                           args=(str(model), engine, packed, lengths, warmup_lengths, args.mb_tokens, args.repeats,
                                 args.device, 256 if args.tiny else 8192, args.profile))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small models and batch (runs on a CPU)")
    parser.add_argument("--models", default="0.5b,8x2048")
    parser.add_argument("--engines", default="dtensor,megatron",
                        help="of dtensor, megatron, dtensor-compile (policy.dtensor_cfg.compile: each decoder layer "
                             "through torch.compile), dtensor-lora and megatron-lora (rank-16 LoRA on every linear "
                             "layer of the decoder: their MFU still counts full-training FLOPs)")
    parser.add_argument("--layouts", default="packed,unpacked")
    parser.add_argument("--seqs", type=int, default=128)
    parser.add_argument("--median", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--mb-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed calls, profile one more and print its top N operators")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu --tiny to check the script runs")
    if args.tiny:
        args.seqs, args.median, args.max_len, args.mb_tokens, args.repeats = 8, 24, 64, 256, 1
    setup_logging()
    lengths = long_tail_lengths(args.seqs, median=args.median, max_len=args.max_len, seed=1)
    warmup_lengths = long_tail_lengths(args.seqs, median=args.median, max_len=args.max_len, seed=2)
    rows, profiles = [], []
    for name in args.models.split(","):
        model = build_model(f"{name}-tiny" if args.tiny else name, dict(MODELS[name], **(TINY if args.tiny else {})))
        for layout in args.layouts.split(","):
            for engine in args.engines.split(","):
                r = measure(model, engine, layout == "packed", lengths, warmup_lengths, args)
                profile = r.pop("profile")
                if profile:
                    profiles.append((f"{name} {engine} {layout}", *profile))
                logger.info("%s %s %s: %s", name, engine, layout, r)
                peak = "n/a" if args.device == "cpu" else f"{r['peak_gib']:.1f}"
                rows.append([name, engine, layout, r["first_s"], r["new_s"], r["warm_s"], f"{r['new_s'] / r['warm_s']:.2f}",
                             f"{r['tokens_per_s']:.0f}", f"{100 * r['mfu']:.1f}%", f"{r['gemm_tflops']:.3g}", peak,
                             f"{r['loss']:.4g}", f"{r['grad_norm']:.4g}"])
    print(f"\ntrain_batch, {len(lengths)} sequences ({sum(lengths)} tokens, median {args.median}, max "
          f"{max(lengths)}), bf16, {args.mb_tokens}-token micro-batches, device {args.device}"
          f"{' (tiny models)' if args.tiny else ''}; MFU against the bf16 GEMM rate measured in each run\n")
    print(markdown_table(["model", "engine", "layout", "first s", "new lengths s", "warm s", "new / warm", "tokens/s", "MFU",
                          "GEMM TFLOP/s", "peak GiB", "loss", "grad norm"], rows))
    unit = "CUDA" if args.device == "cuda" else "CPU"
    for run, top, summary in profiles:
        print(f"\n{run}: top operators of one warm train_batch by self {unit} time ({summary})\n")
        print(markdown_table(["op", "calls", f"self {unit} s", "share"], top))


if __name__ == "__main__":
    main()
