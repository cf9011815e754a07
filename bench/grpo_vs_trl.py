"""Our GRPO trainer vs TRL 1.16 `GRPOTrainer` on one identical workload, side by side in one invocation.

    uv run bench/grpo_vs_trl.py [--steps 5] [--warmup 2]                 # CPU (the default)
    uv run bench/grpo_vs_trl.py --device cuda [--engines dtensor,megatron] # one GPU: the issue-15 workload

CPU workload (both sides): the ~12M-parameter Qwen2 benchmark model (bench/_common.py), fp32, 8 repeat_char
prompts x 8 completions, exactly 128 new tokens per completion (no stop token on our side, min_new_tokens on
TRL's), temperature 1.0, no KL (beta 0), clip eps 0.2 / 0.28, token-level ("dapo" = loss.agg=token-mean)
normalisation, AdamW lr 1e-5 constant, max grad norm 1.0, reward repeat_char with stop_bonus 0.

CUDA workload: the Qwen2.5-0.5B shape with the 128-char vocabulary and Hugging Face's init
(apps/grpo/grpo_app/model_shapes.py), bf16, 32 prompts x 8 completions x up to 256 new tokens (stop token
allowed), one optimizer step per GRPO step (TRL: per-device batch 32 x 8 accumulation steps), 6 steps;
ours with each engine in `--engines`.

Ours runs through the real trainer command (`python apps/grpo --config bench/configs/grpo_vs_trl[_cuda].yaml
...`); TRL runs bench/trl_side.py in its own venv (~/.cache/rl-stack/venv-trl, created on first use). Each
side runs alone (the other waits), its peak memory is the summed RSS and the summed PSS (shared pages split
among the processes mapping them) of its whole process tree (Ray driver, GCS, raylet, actors for ours),
sampled every 100 ms; on CUDA also the GPU memory: torch.cuda.max_memory_allocated of the training process
and the peak total of nvidia-smi's per-process use. Step time: median over steps after `--warmup`.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from _common import CACHE, ROOT, PeakMemory, bench_model_path, markdown_table, setup_logging

logger = logging.getLogger("bench.grpo_vs_trl")
TRL_VENV = CACHE / "venv-trl"
TRL_PINS = ["trl==1.16.0", "torch==2.13.0", "transformers<5.20", "datasets", "accelerate"]
LR, EPS, GRAD_NORM = 1e-5, (0.2, 0.28), 1.0


@dataclass(frozen=True)
class Workload:
    """What both sides run; `full_length` forces every completion to max_new_tokens (no stop token)."""

    config: Path
    prompts: int
    generations: int
    max_new_tokens: int
    answer_len: int
    full_length: bool
    steps: int
    describe: str


WORKLOADS = {
    "cpu": Workload(config=ROOT / "bench/configs/grpo_vs_trl.yaml", prompts=8, generations=8, max_new_tokens=128,
                    answer_len=128, full_length=True, steps=5, describe="~12M Qwen2 fp32"),
    "cuda": Workload(config=ROOT / "bench/configs/grpo_vs_trl_cuda.yaml", prompts=32, generations=8,
                     max_new_tokens=256, answer_len=4, full_length=False, steps=6,
                     describe="Qwen2.5-0.5B shape (vocab 128) bf16, up to 256 new tokens"),
}


def trl_python(given: str | None = None) -> Path:
    """The TRL venv's python, (re)created with uv if it is missing, broken, or holds another torch build.

    `given` (--trl-python) skips the venv: a python that already has trl 1.16 and our torch, for machines
    without a package registry (the GPU kit installs trl beside the project).

    uv resolves torch from PyPI like the workspace lock (and reuses its cached wheels), so both sides run
    the same torch build: the CUDA wheel imports ~290 MB more than a CPU-only one, per process.
    """
    import torch

    python = Path(given) if given else TRL_VENV / "bin" / "python"
    check = [str(python), "-c", "import trl, torch; assert trl.__version__ == '1.16.0', trl.__version__; "
             f"assert torch.__version__ == {torch.__version__!r}, torch.__version__"]
    if given or (python.exists() and subprocess.run(check, capture_output=True).returncode == 0):
        if given:
            subprocess.run(check, check=True)
        return python
    logger.info("creating the TRL venv at %s (%s, torch %s)", TRL_VENV, " ".join(TRL_PINS), torch.__version__)
    subprocess.run(["uv", "venv", "--clear", "--python", sys.executable, str(TRL_VENV)], check=True)
    subprocess.run(["uv", "pip", "install", "--python", str(python), "-q", *TRL_PINS], check=True)
    subprocess.run(check, check=True)
    return python


def write_prompts(work: Path, num: int) -> list[dict]:
    from rollout.environments import toy_prompts

    records = toy_prompts("repeat_char", num, split="train", seed=0)
    with (work / "prompts.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return [{"prompt": r["prompt"], "target": r["metadata"]["target"]} for r in records]


class GpuMemory:
    """Peak of the GPU memory nvidia-smi reports for all compute processes together (each side runs alone),
    sampled every 0.5 s in a thread: what the processes hold, CUDA context and allocator cache included."""

    QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]

    def __enter__(self) -> GpuMemory:
        self.peak_mib, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            out = subprocess.run(self.QUERY, capture_output=True, text=True).stdout
            fields = [line.split(",")[1].strip() for line in out.splitlines() if "," in line]
            # "[N/A]" where the driver cannot report (MIG, some containers): skip it, keep sampling
            used = sum(float(f) for f in fields if f.replace(".", "", 1).isdigit())
            self.peak_mib = max(self.peak_mib, used)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_tree(cmd: list[str], log_path: Path, gpu: bool) -> dict:
    """Run `cmd` with its output to `log_path`: wall s, peak summed RSS and PSS MiB, processes at the peak,
    and with `gpu` the nvidia-smi peak MiB."""
    start = time.perf_counter()
    gpu_mem = GpuMemory() if gpu else None
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemory(proc.pid) as mem:
            if gpu_mem is not None:
                with gpu_mem:
                    code = proc.wait()
            else:
                code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{cmd[:3]} exited with {code}; see {log_path}:\n{log_path.read_text()[-3000:]}")
    logger.info("%s: processes at the RSS peak (name, MiB): %s", log_path.stem,
                [(name, round(mib)) for name, mib in mem.peak_procs])
    return {"wall": time.perf_counter() - start, "peak": mem.peak_mib, "pss": mem.peak_pss_mib,
            "procs": len(mem.peak_procs), "gpu_smi_mib": gpu_mem.peak_mib if gpu_mem else float("nan")}


def our_overrides(model: Path | str, prompts_file: Path, log_dir: Path, load: Workload, engine: str) -> list[str]:
    overrides = [f"policy.model_name={model}", f"env.train_data={prompts_file}", f"logger.log_dir={log_dir}",
                 f"grpo.max_steps={load.steps}", f"policy.optimizer.kwargs.lr={LR}",
                 f"generation.max_new_tokens={load.max_new_tokens}", f"grpo.num_prompts_per_step={load.prompts}",
                 f"grpo.num_generations_per_prompt={load.generations}",
                 f"policy.train_global_batch_size={load.prompts * load.generations}"]
    return overrides + (["policy.megatron_cfg.enabled=true"] if engine == "megatron" else [])


def run_ours(model: Path, work: Path, prompts_file: Path, load: Workload, engine: str, gpu: bool) -> dict:
    log_dir = work / f"ours-{engine}"
    cmd = [sys.executable, "apps/grpo", "--config", str(load.config),
           *our_overrides(model, prompts_file, log_dir, load, engine)]
    logger.info("ours (%s): %s", engine, " ".join(cmd))
    work.mkdir(parents=True, exist_ok=True)
    tree = run_tree(cmd, work / f"ours-{engine}.log", gpu)
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {**tree, "records": records}


def run_trl(model: Path, work: Path, prompts: list[dict], load: Workload, device: str, threads: int,
            python: str | None = None) -> dict:
    spec = {"model": str(model), "prompts": prompts, "generations": load.generations,
            "max_new_tokens": load.max_new_tokens, "full_length": load.full_length, "lr": LR, "eps_low": EPS[0],
            "eps_high": EPS[1], "max_grad_norm": GRAD_NORM, "steps": load.steps, "seed": 42,
            "answer_len": load.answer_len, "threads": threads, "device": device,
            "output_dir": str(work / "trl-out")}
    work.mkdir(parents=True, exist_ok=True)
    (work / "trl_spec.json").write_text(json.dumps(spec))
    cmd = [str(trl_python(python)), str(ROOT / "bench" / "trl_side.py"), str(work / "trl_spec.json"),
           str(work / "trl_out.json")]
    logger.info("TRL: %s", " ".join(cmd))
    tree = run_tree(cmd, work / "trl.log", device == "cuda")
    return {**tree, **json.loads((work / "trl_out.json").read_text())}


def bench_model(device: str) -> Path:
    if device == "cpu":
        return bench_model_path()
    sys.path.insert(0, str(ROOT / "apps" / "grpo"))
    from grpo_app.model_shapes import cached_shape_checkpoint

    return cached_shape_checkpoint("qwen2.5-0.5b", seed=0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(WORKLOADS), default="cpu")
    parser.add_argument("--engines", default="dtensor",
                        help="comma-separated engines for our side: dtensor, megatron (cuda: both is the issue's run)")
    parser.add_argument("--steps", type=int, help="GRPO steps per run (default: 5 on cpu, 6 on cuda)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out of the median")
    parser.add_argument("--rounds", type=int, default=2,
                        help="ours then TRL, this many times: each round's ratio is measured back to back")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-python", help="a python with trl 1.16 and this torch (default: a uv venv)")
    parser.add_argument("--dry-run", action="store_true", help="print the workload and commands' configs, run nothing")
    args = parser.parse_args()
    engines = args.engines.split(",")
    if not set(engines) <= {"dtensor", "megatron"}:
        parser.error(f"--engines={args.engines!r}: choose from dtensor, megatron")
    return args


def our_row(round_: int, engine: str, ours: dict, warmup: int) -> tuple[list, float]:
    steady = [r for r in ours["records"] if r["step"] >= warmup]
    step = statistics.median(r["timing/step_s"] for r in steady)
    gpu_alloc = max((r.get("train/gpu_allocated_gib_max", float("nan")) for r in ours["records"]), default=float("nan"))
    return [f"{round_}", f"ours (apps/grpo, {engine}, torch rollout)", step, f"{ours['peak']:.0f}",
            f"{ours['pss']:.0f}", f"{gpu_alloc:.2f}", f"{ours['gpu_smi_mib']:.0f}", ours["procs"],
            f"{statistics.mean(r['rollout/gen_len_mean'] for r in ours['records']):.1f}",
            f"{statistics.mean(r['rollout/reward_mean'] for r in ours['records']):.3f}", f"{ours['wall']:.0f}"], step


def main() -> None:
    args = parse_args()
    setup_logging()
    load = WORKLOADS[args.device]
    if args.steps:
        load = Workload(**{**load.__dict__, "steps": args.steps})
    if args.dry_run:
        dry_run(load, args.device, args.engines.split(","))
        return
    threads = os.cpu_count() or 1  # our trainer gives each colocated actor all cores; TRL gets the same
    model = bench_model(args.device)
    work = Path(tempfile.mkdtemp(prefix="grpo_vs_trl-"))
    prompts = write_prompts(work, load.prompts)
    rows, records, ratios = [], [], []
    gpu = args.device == "cuda"
    for round_ in range(args.rounds):
        our_steps = {}
        for engine in args.engines.split(","):
            ours = run_ours(model, work / f"round{round_}", work / "prompts.jsonl", load, engine, gpu)
            records += [dict(r, engine=engine) for r in ours["records"] if r["step"] >= args.warmup]
            row, our_steps[engine] = our_row(round_, engine, ours, args.warmup)
            rows.append(row)
        if args.skip_trl:
            continue
        trl = run_trl(model, work / f"round{round_}", prompts, load, args.device, threads, args.trl_python)
        trl_step = statistics.median(trl["step_s"][args.warmup:])
        rows.append([f"{round_}", "TRL 1.16 GRPOTrainer", trl_step, f"{trl['peak']:.0f}", f"{trl['pss']:.0f}",
                     f"{trl.get('gpu_peak_allocated_gib', float('nan')):.2f}", f"{trl['gpu_smi_mib']:.0f}",
                     trl["procs"], f"{statistics.mean(trl['completion_len']):.1f}",
                     f"{statistics.mean(trl['reward']):.3f}", f"{trl['wall']:.0f}"])
        for engine, step in our_steps.items():
            ratios.append((engine, trl_step / step))
            rows.append([f"{round_}", f"ours ({engine}) vs TRL", f"{ratios[-1][1]:.2f}x speed-up (TRL s / ours s)",
                         *[""] * 8])
    logger.info("logs under %s", work)
    print(f"\n{load.prompts} prompts x {load.generations} completions x {load.max_new_tokens} new tokens, "
          f"{load.describe}, median of steps {args.warmup}..{load.steps - 1}, {args.rounds} rounds "
          f"(ours, then TRL)\n")
    print(markdown_table(["round", "side", "median step s", "peak RSS MiB (tree)", "peak PSS MiB (tree)",
                          "GPU max allocated GiB", "GPU peak MiB (nvidia-smi)", "procs", "mean completion len",
                          "mean reward", "total wall s"], rows))
    for engine in args.engines.split(","):
        speed = [r for e, r in ratios if e == engine]
        if speed:
            print(f"\nMedian over rounds, {engine}: {statistics.median(speed):.2f}x speed-up (TRL s / ours s)")
        print_phases(engine, [r for r in records if r["engine"] == engine])


def dry_run(load: Workload, device: str, engines: list[str]) -> None:
    """Validate our side's config for each engine as the run would load it (on a simulated one-GPU machine
    for cuda: no GPU needed) and print the resolved layout; builds no model and starts nothing."""
    sys.path.insert(0, str(ROOT / "apps" / "grpo"))
    from grpo_app.config import load_config
    from grpo_app.devices import Hardware
    from grpo_app.refit import refit_path

    hardware = Hardware(cuda_available=device == "cuda", bf16_supported=device == "cuda", num_gpus=int(device == "cuda"))
    model = "shape:qwen2.5-0.5b" if device == "cuda" else bench_model_path()
    for engine in engines:
        cfg = load_config(load.config, our_overrides(model, Path("prompts.jsonl"), Path("runs/dry"), load, engine),
                          hardware=hardware)
        print(f"{engine}: device {cfg.cluster.device}, precision {cfg.policy.precision}, "
              f"{cfg.grpo.num_prompts_per_step} x {cfg.grpo.num_generations_per_prompt} x "
              f"{cfg.generation.max_new_tokens} tokens, refit {refit_path(cfg).value}, generator "
              f"{cfg.generation.backend_kwargs}")


def print_phases(engine: str, records: list[dict]) -> None:
    timing = {k for r in records for k in r if k.startswith("timing/")}
    med = {k: statistics.median(r.get(k, 0.0) for r in records) for k in timing}
    phases = [[k.removeprefix("timing/").removesuffix("_s"), v, f"{100 * v / med['timing/step_s']:.0f}%"]
              for k, v in sorted(med.items(), key=lambda kv: -kv[1]) if k != "timing/step_s"]
    print(f"\nOur per-phase breakdown, {engine} (median s per step over all rounds, metrics.jsonl):\n")
    print(markdown_table(["phase", "s", "share of step"], phases))
    # the trainer / sampler mismatch of these same steps (issue 15's bar on a GPU: <= 1.1 in bf16, NeMo-RL's)
    mismatch = [r["train/token_mult_prob_error"] for r in records if r.get("train/token_mult_prob_error") is not None]
    gen_kl = [r["train/gen_kl"] for r in records if r.get("train/gen_kl") is not None]
    if mismatch:
        print(f"\n{engine}: token_mult_prob_error median {statistics.median(mismatch):.4f} (max {max(mismatch):.4f}), "
              f"gen KL median {statistics.median(gen_kl):.2e}, over {len(mismatch)} steps")


if __name__ == "__main__":
    main()
