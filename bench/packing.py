"""Padded vs packed training pass through the real DTensorEngine on a long-tailed length mix.

    uv run bench/packing.py [--seqs 64] [--median 96] [--max-len 1024] [--mb-tokens 2048] [--mb-seqs 8] [--repeats 3]

All runs use the ~12M Qwen2 benchmark model (bench/_common.py), fp32 and the same batch.
Padded, data order = what a DataLoader + padding collator with gradient accumulation does: --mb-seqs
sequences per micro-batch in the batch's order, each row padded to its micro-batch's longest (the bench
calls `forward_backward` per chunk, then one `optimizer_step`). The engine's own padded layouts sort the
batch by decreasing length before cutting it: fixed = `train_micro_batch_size` (--mb-seqs) sequences per
micro-batch; dynamic = `dynamic_batching` (micro-batches cut by a padded-token budget, lengths rounded to
16). Packed = `sequence_packing` (mffd bins, one row per bin; on CPU the attention is `sdpa_segments`, one
causal sdpa per packed sequence).
"Tokens processed" counts every position fed to the model (padding included) with a forward pre-hook;
time is the median wall time of `engine.train_batch` after one warm-up call.
The three runs are measured in the same process, one right after the other.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import time

import torch
from _common import (
    bench_model_path,
    count_model_tokens,
    long_tail_lengths,
    make_batch,
    markdown_table,
    policy_config,
    setup_logging,
)

logger = logging.getLogger("bench.packing")


def train_step(engine, batch, loss, *, mode: str, mb_seqs: int) -> int:
    """One optimizer step over the batch; returns the number of micro-batches."""
    if mode != "data-order":
        return int(engine.train_batch(batch, loss)["num_micro_batches"])
    engine.zero_grad()  # a chunk of mb_seqs is one engine micro-batch, so nothing is reordered
    chunks = [range(i, min(i + mb_seqs, len(batch))) for i in range(0, len(batch), mb_seqs)]
    for chunk in chunks:
        engine.forward_backward(batch.select(chunk), loss)
    engine.optimizer_step()
    return len(chunks)


def run(model, lengths: list[int], *, mode: str, mb_tokens: int, mb_seqs: int, repeats: int) -> dict:
    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine

    # "fixed" / "data-order": micro-batches of mb_seqs sequences, each padded to its longest (no budget).
    extra = ({"dynamic_batching": {"enabled": False}, "train_micro_batch_size": mb_seqs,
              "logprob_batch_size": mb_seqs} if mode in ("fixed", "data-order") else {})
    engine = create_engine(policy_config(model, packing=mode == "packed", mb_tokens=mb_tokens, **extra))
    vocab = engine.model.config.vocab_size
    batch = make_batch(lengths, vocab, seed=0)
    batch = batch.with_fields(prev_logprobs=engine.compute_logprobs(batch))
    loss = ClippedPGLoss()
    train_step(engine, batch, loss, mode=mode, mb_seqs=mb_seqs)  # warm-up: allocator, first-call paths
    seen = count_model_tokens(engine.model)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        micro_batches = train_step(engine, batch, loss, mode=mode, mb_seqs=mb_seqs)
        times.append(time.perf_counter() - start)
    logger.info("%s: %s s", mode, [round(t, 2) for t in times])
    out = {"tokens": seen[0] // repeats, "median_s": statistics.median(times), "times": times,
           "micro_batches": micro_batches}
    del engine
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--mb-tokens", type=int, default=2048)
    parser.add_argument("--mb-seqs", type=int, default=8, help="sequences per micro-batch of the fixed layout")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(os.cpu_count() or 1)
    model = bench_model_path()
    lengths = long_tail_lengths(args.seqs, median=args.median, max_len=args.max_len, seed=0)
    real = sum(lengths)
    logger.info("lengths: %d seqs, %d tokens, mean %.0f, max %d", len(lengths), real, real / len(lengths),
                max(lengths))
    kw = {"mb_tokens": args.mb_tokens, "mb_seqs": args.mb_seqs, "repeats": args.repeats}
    n = args.mb_seqs
    baselines = {  # short name -> (table label, mode)
        "data order": (f"padded, data order, {n} seqs per micro-batch (collator)", "data-order"),
        "sorted fixed": (f"padded, length-sorted, {n} seqs per micro-batch", "fixed"),
        "sorted dynamic": ("padded, length-sorted, dynamic_batching (token budget)", "dynamic"),
    }
    results = {short: run(model, lengths, mode=mode, **kw) for short, (_, mode) in baselines.items()}
    packed = run(model, lengths, mode="packed", **kw)
    rows = []
    labels = [label for label, _ in baselines.values()] + ["packed (sequence_packing, mffd)"]
    for name, r in zip(labels, [*results.values(), packed]):
        rows.append([name, real, r["tokens"], f"{100 * (1 - real / r['tokens']):.0f}%", r["micro_batches"],
                     r["median_s"], f"{real / r['median_s']:.0f}"])
    for short, r in results.items():
        rows.append([f"{short} / packed", "", f"{r['tokens'] / packed['tokens']:.2f}x fewer tokens", "", "",
                     f"{r['median_s'] / packed['median_s']:.2f}x faster", ""])
    print(f"\ntrain_batch on {len(lengths)} sequences, lognormal lengths (median {args.median}, "
          f"mean {real / len(lengths):.0f}, max {max(lengths)}), {args.mb_tokens}-token micro-batches, "
          f"~12M Qwen2 fp32, {torch.get_num_threads()} threads, median of {args.repeats}\n")
    print(markdown_table(["layout", "real tokens", "tokens processed", "padding", "micro-batches",
                          "train_batch s", "real tokens/s"], rows))


if __name__ == "__main__":
    main()
