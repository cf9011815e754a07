"""On-policy GRPO vs `grpo.async_rollouts` (one step off-policy), side by side in one invocation.

    uv run bench/async_rollouts.py [--steps 6] [--warmup 2] [--rounds 2] [--engine dtensor]

The workload is bench/grpo_vs_trl.py's CPU one (the ~12M-parameter Qwen2 benchmark model, fp32, 8 prompts x 8
completions x exactly 128 new tokens), through the real trainer command, with generation workers of their own
(`generation.colocated=false`, `in_policy_workers=false`) and TIS importance correction on both sides, so the
only difference is `grpo.async_rollouts`. The rounds alternate (on-policy, async). Per variant: the median step
time after `--warmup` steps, the median of each phase (async: generation and scoring run beside the previous
step's training; `rollout wait` is what a step still waited for them) and the mean train reward.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

from _common import markdown_table, setup_logging
from grpo_vs_trl import WORKLOADS, Workload, bench_model, our_overrides, run_tree, write_prompts

logger = logging.getLogger("bench.async_rollouts")
SEPARATE_GENERATION = ["generation.colocated=false", "generation.in_policy_workers=false",
                       "loss.importance.enabled=true"]
VARIANTS = {"on-policy": [], "async": ["grpo.async_rollouts=true"]}


def run_variant(name: str, model: Path, work: Path, load: Workload, engine: str) -> list[dict]:
    log_dir = work / name
    cmd = [sys.executable, "apps/grpo", "--config", str(load.config),
           *our_overrides(model, work.parent / "prompts.jsonl", log_dir, load, engine), *SEPARATE_GENERATION,
           *VARIANTS[name]]
    logger.info("%s: %s", name, " ".join(cmd))
    work.mkdir(parents=True, exist_ok=True)
    tree = run_tree(cmd, work / f"{name}.log", gpu=False)
    logger.info("%s: %.0f s wall", name, tree["wall"])
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=2, help="on-policy then async, this many times")
    parser.add_argument("--engine", choices=["dtensor", "megatron"], default="dtensor")
    args = parser.parse_args()
    setup_logging()
    load = Workload(**{**WORKLOADS["cpu"].__dict__, "steps": args.steps})
    model = bench_model("cpu")
    work = Path(tempfile.mkdtemp(prefix="async_rollouts-"))
    write_prompts(work, load.prompts)
    steps: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for round_ in range(args.rounds):
        for name in VARIANTS:
            records = run_variant(name, model, work / f"round{round_}", load, args.engine)
            steps[name] += [r for r in records if r["step"] >= args.warmup and "timing/step_s" in r]
    phases = ["generate", "reward", "rollout_wait", "logprobs", "train", "refit"]
    rows, medians = [], {}
    for name, records in steps.items():
        medians[name] = statistics.median(r["timing/step_s"] for r in records)
        rows.append([name, medians[name], *[statistics.median(r.get(f"timing/{p}_s", 0.0) for r in records)
                                            for p in phases],
                     f"{statistics.mean(r['rollout/reward_mean'] for r in records):.3f}",
                     f"{statistics.mean(r['train/token_mult_prob_error'] for r in records):.4f}"])
    logger.info("logs under %s", work)
    print(f"\n{load.prompts} prompts x {load.generations} completions x {load.max_new_tokens} new tokens, "
          f"{load.describe}, {args.engine}, medians of steps {args.warmup}..{load.steps - 1} over {args.rounds} "
          "rounds (on-policy, then async)\n")
    print(markdown_table(["variant", "step s", "generate s", "reward s", "rollout wait s", "logprobs s", "train s",
                          "refit s", "mean reward", "token_mult_prob_error"], rows))
    print(f"\nasync vs on-policy: {medians['on-policy'] / medians['async']:.2f}x step speed-up")


if __name__ == "__main__":
    main()
