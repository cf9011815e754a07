"""DTensor vs Megatron-Core `train_batch` step time on the same model and batch, CPU, 1 and 2 ranks.

    uv run bench/engines.py [--seqs 32] [--median 96] [--max-len 512] [--mb-tokens 2048] [--repeats 3]

Every configuration runs in fresh gloo ranks forked by `rl_core.testing.distributed.run_distributed`
(1 torch thread per rank, so 1 rank uses one core and 2 ranks use both). The model is the ~12M Qwen2
benchmark model (bench/_common.py), fp32; both engines get the same TokenBatch (a long-tailed length mix,
sequence packing with the same token budget). With 2 ranks the batch is split data-parallel (each rank
gets every other sequence; the loss normalisers are global), and with `--tp` also run TP=2. Time: the
median wall time of `train_batch` after one warm-up call, max over ranks.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from _common import (
    bench_model_path,
    long_tail_lengths,
    make_batch,
    markdown_table,
    policy_config,
    setup_logging,
)

logger = logging.getLogger("bench.engines")


def _rank_fn(rank: int, world: int, model: str, lengths: list[int], engine_name: str, tp: int, mb_tokens: int,
             repeats: int) -> dict:
    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine

    megatron = engine_name == "megatron"
    extra = ({"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": tp}} if megatron
             else {"dtensor_cfg": {"tensor_parallel_size": tp}})
    policy = policy_config(model, packing=True, mb_tokens=mb_tokens, megatron=megatron, **extra)
    engine = create_engine(policy)
    dp = world // tp
    dp_rank = rank // tp
    from transformers import AutoConfig

    batch = make_batch(lengths, AutoConfig.from_pretrained(model).vocab_size, seed=0)
    batch = batch.select(list(range(len(lengths)))[dp_rank::dp])
    batch = batch.with_fields(prev_logprobs=engine.compute_logprobs(batch))
    loss = ClippedPGLoss()
    engine.train_batch(batch, loss)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        metrics = engine.train_batch(batch, loss)
        times.append(time.perf_counter() - start)
    return {"times": times, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"]}


def measure(model: str, lengths: list[int], engine: str, world: int, tp: int, mb_tokens: int,
            repeats: int) -> dict:
    from rl_core.testing.distributed import run_distributed

    results = run_distributed(_rank_fn, world_size=world, timeout=900.0,
                              args=(model, lengths, engine, tp, mb_tokens, repeats))
    per_step = [max(r["times"][i] for r in results) for i in range(repeats)]  # a step ends when all ranks do
    logger.info("%s world=%d tp=%d: %s s", engine, world, tp, [round(t, 2) for t in per_step])
    return {"median_s": statistics.median(per_step), "loss": results[0]["loss"], "grad_norm": results[0]["grad_norm"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--mb-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", action="store_true", help="also run tensor parallel 2 on 2 ranks")
    args = parser.parse_args()
    setup_logging()
    model = str(bench_model_path())
    lengths = long_tail_lengths(args.seqs, median=args.median, max_len=args.max_len, seed=1)
    layouts = [(1, 1), (2, 1)] + ([(2, 2)] if args.tp else [])
    results = {}
    for world, tp in layouts:
        for engine in ("dtensor", "megatron"):
            results[engine, world, tp] = measure(model, lengths, engine, world, tp, args.mb_tokens, args.repeats)
    rows = []
    for world, tp in layouts:
        d, m = results["dtensor", world, tp], results["megatron", world, tp]
        layout = f"{world} rank{'s' if world > 1 else ''} (dp={world // tp}, tp={tp})"
        rows.append([layout, d["median_s"], m["median_s"], f"{m['median_s'] / d['median_s']:.2f}",
                     f"{d['loss']:.4g} / {m['loss']:.4g}", f"{d['grad_norm']:.4g} / {m['grad_norm']:.4g}"])
    print(f"\ntrain_batch on {len(lengths)} sequences ({sum(lengths)} tokens, max {max(lengths)}), packed, "
          f"{args.mb_tokens}-token micro-batches, ~12M Qwen2 fp32, 1 thread per rank, median of {args.repeats}\n")
    print(markdown_table(["layout", "DTensor s", "Megatron s", "Megatron / DTensor", "loss (D / M)",
                          "grad norm (D / M)"], rows))


if __name__ == "__main__":
    main()
