"""Model FLOPs utilisation of a DTensorEngine training pass against this machine's measured GEMM rate.

    uv run bench/mfu.py [--layout padded|packed] [--seqs 64] [--seq-len 133] [--mb-tokens 4096] [--profile]

1. GEMM rate: median time of square `torch.mm` (n = 2048, fp32 and bf16) on `--threads` threads,
   2 n^3 FLOPs each.
2. Training pass: `engine.train_batch` (forward, backward, AdamW step) of the ~12M Qwen2 benchmark model
   (bench/_common.py) on the GRPO benchmark's batch shape (64 rows of 5 prompt + 128 completion tokens),
   fp32, padded micro-batches of --mb-tokens (`dynamic_batching`, the GRPO bench config) or packed ones
   (`sequence_packing`), median wall time after one warm-up call.
   Model FLOPs per pass = 6 * N * T + 12 * L * d * sum_i(len_i^2), with N the parameters that take part in
   matmuls (all but the input embedding), T the real tokens, L layers, d hidden size, len_i the sequence
   lengths (the PaLM convention: QK^T and AV, forward + backward, causal masking not halved). Padding and
   the masked-out attention between packed neighbours are not counted: they are not model FLOPs.
   MFU = model FLOPs / time / GEMM rate (fp32, the precision of the pass).
With `--profile`, one more pass runs under torch.profiler and the top operators by self CPU time print.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from _common import bench_model_path, make_batch, markdown_table, policy_config, setup_logging

logger = logging.getLogger("bench.mfu")


def gemm_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Measured FLOP/s of an n x n x n matmul in `dtype` (median of `repeats` after a warm-up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def model_flops(model: torch.nn.Module, lengths: list[int]) -> tuple[float, int]:
    """(FLOPs of one training pass by 6 N T + 12 L d sum len^2, N) for `model` on sequences of `lengths`."""
    cfg = model.config
    n_matmul = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if getattr(cfg, "tie_word_embeddings", False):  # parameters() counts the shared matrix once: the LM head
        n_matmul += model.get_input_embeddings().weight.numel()
    dense = 6 * n_matmul * sum(lengths)
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * sum(x * x for x in lengths)
    return float(dense + attention), n_matmul


def profile_pass(engine, batch, loss, top: int, device: str = "cpu") -> tuple[list[list], str]:
    """The top operators of one train_batch by self time on `device` (CUDA kernels on a GPU, else CPU), and
    a line comparing the pass's wall time with that summed self time: far apart on a GPU means the step
    waits on the host (Python, launches, syncs), not on kernels."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    if cuda:
        torch.cuda.synchronize()  # earlier queued work must not count as this pass's wall time
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        engine.train_batch(batch, loss)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in events)
    rows = [[e.key, e.count, getattr(e, attr) / 1e6, f"{100 * getattr(e, attr) / total:.1f}%"] for e in events[:top]]
    where = "CUDA kernels" if cuda else "CPU operators"
    return rows, f"wall {wall:.2f} s (profiled), {where} {total / 1e6:.2f} s of self time"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=133, help="5 prompt + 128 completion tokens")
    parser.add_argument("--mb-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layout", choices=["padded", "packed"], default="padded")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(args.threads)
    rates = {name: gemm_rate(dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    logger.info("GEMM rates: %s", {k: f"{v / 1e9:.1f} GFLOP/s" for k, v in rates.items()})

    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine

    engine = create_engine(policy_config(bench_model_path(), packing=args.layout == "packed",
                                         mb_tokens=args.mb_tokens))
    torch.set_num_threads(args.threads)  # engine creation may reset the thread count
    lengths = [args.seq_len] * args.seqs
    batch = make_batch(lengths, engine.model.config.vocab_size, seed=0)
    batch = batch.with_fields(prev_logprobs=engine.compute_logprobs(batch))
    loss = ClippedPGLoss()
    engine.train_batch(batch, loss)  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        engine.train_batch(batch, loss)
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    flops, n_matmul = model_flops(engine.model, lengths)
    achieved = flops / step
    print(f"\n~12M Qwen2 (N = {n_matmul / 1e6:.2f}M matmul params), train_batch on {args.seqs} x {args.seq_len} "
          f"tokens, {args.layout} {args.mb_tokens}-token micro-batches, fp32, {args.threads} threads, "
          f"median of {args.repeats}\n")
    rows = [["GEMM fp32 (2048^3 mm)", f"{rates['fp32'] / 1e9:.1f}", ""],
            ["GEMM bf16 (2048^3 mm)", f"{rates['bf16'] / 1e9:.1f}", ""],
            [f"train_batch: {flops / 1e9:.0f} GFLOP in {step:.2f} s", f"{achieved / 1e9:.1f}",
             f"MFU {100 * achieved / rates['fp32']:.0f}% of fp32 GEMM ({100 * achieved / rates['bf16']:.0f}% of bf16)"]]
    print(markdown_table(["what", "GFLOP/s", "utilisation"], rows))
    if args.profile:
        rows, summary = profile_pass(engine, batch, loss, 15)
        print(f"\nTop operators of one train_batch by self CPU time (torch.profiler; {summary}):\n")
        print(markdown_table(["op", "calls", "self CPU s", "share"], rows))


if __name__ == "__main__":
    main()
