"""Our GRPO trainer vs TRL 1.16 `GRPOTrainer` on one identical CPU workload, side by side in one invocation.

    uv run bench/grpo_vs_trl.py [--steps 5] [--warmup 2]

Workload (both sides): the ~12M-parameter Qwen2 benchmark model (bench/_common.py), fp32, 8 repeat_char
prompts x 8 completions, exactly 128 new tokens per completion (no stop token on our side, min_new_tokens on
TRL's), temperature 1.0, no KL (beta 0), clip eps 0.2 / 0.28, token-level ("dapo" = loss.agg=token-mean)
normalisation, AdamW lr 1e-5 constant, max grad norm 1.0, reward repeat_char with stop_bonus 0.

Ours runs through the real trainer command (`python apps/grpo --config bench/configs/grpo_vs_trl.yaml ...`);
TRL runs bench/trl_side.py in its own venv (~/.cache/rl-stack/venv-trl, created on first use). Each side runs
alone (the other waits), its peak memory is the summed RSS and the summed PSS (shared pages split among
the processes mapping them) of its whole process tree (Ray driver, GCS, raylet, actors for ours), sampled
every 100 ms. Step time: median over steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import CACHE, ROOT, PeakMemory, bench_model_path, markdown_table, setup_logging

logger = logging.getLogger("bench.grpo_vs_trl")
TRL_VENV = CACHE / "venv-trl"
TRL_PINS = ["trl==1.16.0", "torch==2.13.0", "transformers<5.20", "datasets", "accelerate"]
CONFIG = ROOT / "bench" / "configs" / "grpo_vs_trl.yaml"
PROMPTS, GENERATIONS, MAX_NEW, LR, EPS, GRAD_NORM, ANSWER_LEN = 8, 8, 128, 1e-5, (0.2, 0.28), 1.0, 128


def trl_python() -> Path:
    """The TRL venv's python, (re)created with uv if it is missing, broken, or holds another torch build.

    uv resolves torch from PyPI like the workspace lock (and reuses its cached wheels), so both sides run
    the same torch build: the CUDA wheel imports ~290 MB more than a CPU-only one, per process.
    """
    import torch

    python = TRL_VENV / "bin" / "python"
    check = [str(python), "-c", "import trl, torch; assert trl.__version__ == '1.16.0', trl.__version__; "
             f"assert torch.__version__ == {torch.__version__!r}, torch.__version__"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    logger.info("creating the TRL venv at %s (%s, torch %s)", TRL_VENV, " ".join(TRL_PINS), torch.__version__)
    subprocess.run(["uv", "venv", "--clear", "--python", sys.executable, str(TRL_VENV)], check=True)
    subprocess.run(["uv", "pip", "install", "--python", str(python), "-q", *TRL_PINS], check=True)
    subprocess.run(check, check=True)
    return python


def write_prompts(work: Path) -> list[dict]:
    from rollout.environments import toy_prompts

    records = toy_prompts("repeat_char", PROMPTS, split="train", seed=0)
    with (work / "prompts.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return [{"prompt": r["prompt"], "target": r["metadata"]["target"]} for r in records]


def run_tree(cmd: list[str], log_path: Path) -> dict:
    """Run `cmd` with its output to `log_path`: wall s, peak summed RSS and PSS MiB, processes at the peak."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemory(proc.pid) as mem:
            code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{cmd[:3]} exited with {code}; see {log_path}:\n{log_path.read_text()[-3000:]}")
    logger.info("%s: processes at the RSS peak (name, MiB): %s", log_path.stem,
                [(name, round(mib)) for name, mib in mem.peak_procs])
    return {"wall": time.perf_counter() - start, "peak": mem.peak_mib, "pss": mem.peak_pss_mib,
            "procs": len(mem.peak_procs)}


def run_ours(model: Path, work: Path, prompts_file: Path, steps: int) -> dict:
    log_dir = work / "ours"
    cmd = [sys.executable, "apps/grpo", "--config", str(CONFIG), f"policy.model_name={model}",
           f"env.train_data={prompts_file}", f"logger.log_dir={log_dir}", f"grpo.max_steps={steps}",
           f"policy.optimizer.kwargs.lr={LR}", f"generation.max_new_tokens={MAX_NEW}"]
    logger.info("ours: %s", " ".join(cmd))
    work.mkdir(parents=True, exist_ok=True)
    tree = run_tree(cmd, work / "ours.log")
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {**tree, "records": records}


def run_trl(model: Path, work: Path, prompts: list[dict], steps: int, threads: int) -> dict:
    spec = {"model": str(model), "prompts": prompts, "generations": GENERATIONS, "max_new_tokens": MAX_NEW,
            "lr": LR, "eps_low": EPS[0], "eps_high": EPS[1], "max_grad_norm": GRAD_NORM, "steps": steps,
            "seed": 42, "answer_len": ANSWER_LEN, "threads": threads, "output_dir": str(work / "trl-out")}
    work.mkdir(parents=True, exist_ok=True)
    (work / "trl_spec.json").write_text(json.dumps(spec))
    cmd = [str(trl_python()), str(ROOT / "bench" / "trl_side.py"), str(work / "trl_spec.json"),
           str(work / "trl_out.json")]
    logger.info("TRL: %s", " ".join(cmd))
    tree = run_tree(cmd, work / "trl.log")
    return {**tree, **json.loads((work / "trl_out.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2,
                        help="ours then TRL, this many times: each round's ratio is measured back to back")
    parser.add_argument("--skip-trl", action="store_true")
    args = parser.parse_args()
    setup_logging()
    threads = os.cpu_count() or 1  # our trainer gives each colocated actor all cores; TRL gets the same
    model = bench_model_path()
    work = Path(tempfile.mkdtemp(prefix="grpo_vs_trl-"))
    prompts = write_prompts(work)
    rows, records, ratios = [], [], []
    for round_ in range(args.rounds):
        ours = run_ours(model, work / f"round{round_}", work / "prompts.jsonl", args.steps)
        steady = [r for r in ours["records"] if r["step"] >= args.warmup]
        records += steady
        our_step = statistics.median(r["timing/step_s"] for r in steady)
        rows.append([f"{round_}", "ours (apps/grpo, DTensor, torch rollout)", our_step, f"{ours['peak']:.0f}",
                     f"{ours['pss']:.0f}", ours["procs"],
                     f"{statistics.mean(r['rollout/gen_len_mean'] for r in ours['records']):.1f}",
                     f"{statistics.mean(r['rollout/reward_mean'] for r in ours['records']):.3f}", f"{ours['wall']:.0f}"])
        if args.skip_trl:
            continue
        trl = run_trl(model, work / f"round{round_}", prompts, args.steps, threads)
        trl_step = statistics.median(trl["step_s"][args.warmup:])
        rows.append([f"{round_}", "TRL 1.16 GRPOTrainer", trl_step, f"{trl['peak']:.0f}", f"{trl['pss']:.0f}",
                     trl["procs"], f"{statistics.mean(trl['completion_len']):.1f}",
                     f"{statistics.mean(trl['reward']):.3f}", f"{trl['wall']:.0f}"])
        ratios.append((trl_step / our_step, ours["peak"] / trl["peak"], ours["pss"] / trl["pss"]))
        rows.append([f"{round_}", "ours vs TRL", f"{ratios[-1][0]:.2f}x speed-up (TRL s / ours s)",
                     f"{ratios[-1][1]:.2f}x RSS (ours / TRL)", f"{ratios[-1][2]:.2f}x PSS (ours / TRL)",
                     "", "", "", ""])
    logger.info("logs under %s", work)
    print(f"\n{PROMPTS} prompts x {GENERATIONS} completions x {MAX_NEW} new tokens, ~12M Qwen2 fp32, "
          f"median of steps {args.warmup}..{args.steps - 1}, {args.rounds} rounds (ours, then TRL)\n")
    print(markdown_table(["round", "side", "median step s", "peak RSS MiB (tree)", "peak PSS MiB (tree)", "procs",
                          "mean completion len", "mean reward", "total wall s"], rows))
    if ratios:
        speed, rss, pss = (statistics.median(r[i] for r in ratios) for i in range(3))
        print(f"\nMedian over rounds: {speed:.2f}x speed-up, {rss:.2f}x RSS, {pss:.2f}x PSS (ours / TRL)")
    timing = {k for r in records for k in r if k.startswith("timing/")}
    med = {k: statistics.median(r.get(k, 0.0) for r in records) for k in timing}
    phases = [[k.removeprefix("timing/").removesuffix("_s"), v, f"{100 * v / med['timing/step_s']:.0f}%"]
              for k, v in sorted(med.items(), key=lambda kv: -kv[1]) if k != "timing/step_s"]
    print("\nOur per-phase breakdown (median s per step over all rounds, metrics.jsonl):\n")
    print(markdown_table(["phase", "s", "share of step"], phases))


if __name__ == "__main__":
    main()
