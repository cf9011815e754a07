"""Packing benchmark: efficiency and speed of seqpack's bin packing, and tokens processed padded vs packed.

Run from the workspace root:  uv run packages/seqpack/bench/bench_packing.py [--num-seqs 100000]

Efficiency = real tokens / (bins x capacity). Length mixes (capacity 8192): lognormal with mean 800,
uniform on [16, 4096], bimodal (half short lognormal around 300, half long normal 6000 +- 1000).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from seqpack import pack_bins, plan_micro_batches
from seqpack.microbatch import micro_batch_cost

CAPACITY = 8192
ALGORITHMS = ["mffd", "ffd", "bfd", "concat"]


def make_lengths(mix: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if mix == "lognormal":  # mean exp(mu + sigma^2/2) = 800
        sigma = 1.0
        x = rng.lognormal(np.log(800) - sigma**2 / 2, sigma, n)
    elif mix == "uniform":
        x = rng.uniform(16, 4096, n)
    elif mix == "bimodal":
        short = rng.lognormal(np.log(300), 0.5, n)
        long = rng.normal(6000, 1000, n)
        x = np.where(rng.random(n) < 0.5, short, long)
    else:
        raise ValueError(f"unknown mix {mix!r}")
    return np.clip(np.round(x), 1, CAPACITY).astype(np.int64)


def efficiency(lengths: np.ndarray, num_bins: int) -> float:
    return float(lengths.sum()) / (num_bins * CAPACITY)


def lower_bound_bins(lengths: np.ndarray) -> int:
    """No packing beats ceil(tokens / capacity), nor one bin per sequence longer than capacity / 2."""
    return max(-(-int(lengths.sum()) // CAPACITY), int(np.count_nonzero(2 * lengths > CAPACITY)))


def bench_algorithms(mixes: list[str], num_seqs: int, small: int, repeats: int, seed: int) -> None:
    print(f"\nPacking into capacity {CAPACITY}: efficiency = real tokens / (bins x capacity)")
    print(f"'bound' = efficiency of the lower bound on bins; time = median of {repeats} runs (wall / CPU)")
    header = (
        f"{'mix':<10} {'algorithm':<9} {'eff n=' + str(small):>11} {'eff n=' + str(num_seqs):>13} "
        f"{'bound':>8} {'wall n=' + str(num_seqs):>14} {'cpu':>8}"
    )
    print(header)
    print("-" * len(header))
    for mix in mixes:
        rng = np.random.default_rng(seed)
        big = make_lengths(mix, num_seqs, rng)
        few = make_lengths(mix, small, rng)
        bound = efficiency(big, lower_bound_bins(big))
        for algorithm in ALGORITHMS:
            walls, cpus = [], []
            for _ in range(repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                bins = pack_bins(big, CAPACITY, algorithm)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            eff_small = efficiency(few, len(pack_bins(few, CAPACITY, algorithm)))
            print(
                f"{mix:<10} {algorithm:<9} {eff_small:>11.2%} {efficiency(big, len(bins)):>13.2%} {bound:>8.2%} "
                f"{statistics.median(walls):>13.3f}s {statistics.median(cpus):>7.3f}s"
            )


def bench_tokens(mixes: list[str], num_seqs: int, batch_size: int, seed: int) -> None:
    print(
        f"\nTokens computed for {num_seqs} sequences (x real tokens) and forward passes; budget {CAPACITY} "
        "tokens per micro-batch.\npadded: (seqs x longest) per micro-batch; packed: sum of lengths (varlen)"
    )
    columns = [f"fixed bs={batch_size}", "budget unsorted", "budget sorted", "budget packed"]
    header = f"{'mix':<10} {'real':>8} " + " ".join(f"{c:>22}" for c in columns)
    print(header)
    print("-" * len(header))
    for mix in mixes:
        lengths = make_lengths(mix, num_seqs, np.random.default_rng(seed))
        real = int(lengths.sum())
        # fixed-size batches in arrival order, each padded to its longest sequence
        fixed = [list(range(s, min(s + batch_size, num_seqs))) for s in range(0, num_seqs, batch_size)]
        plans = [
            (fixed, False),
            (plan_micro_batches(lengths, max_tokens=CAPACITY, sort_window=1).micro_batches, False),
            (plan_micro_batches(lengths, max_tokens=CAPACITY).micro_batches, False),
            (plan_micro_batches(lengths, max_tokens=CAPACITY, packing=True).micro_batches, True),
        ]
        cells = []
        for micro_batches, packing in plans:
            tokens = sum(micro_batch_cost(lengths, mb, packing=packing) for mb in micro_batches)
            cells.append(f"{tokens / real:>5.2f}x {len(micro_batches):>6} passes")
        print(f"{mix:<10} {real / 1e6:>7.2f}M " + " ".join(f"{c:>22}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=100_000, help="sequences for the timing column")
    parser.add_argument("--small", type=int, default=1024, help="sequences for the small-batch efficiency")
    parser.add_argument("--token-seqs", type=int, default=4096, help="sequences for the tokens table")
    parser.add_argument("--batch-size", type=int, default=8, help="fixed batch size of the naive padded run")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median is shown)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    mixes = ["lognormal", "uniform", "bimodal"]
    bench_algorithms(mixes, args.num_seqs, args.small, args.repeats, args.seed)
    bench_tokens(mixes, args.token_seqs, args.batch_size, args.seed)


if __name__ == "__main__":
    main()
