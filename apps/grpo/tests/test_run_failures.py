"""A run that stops on a failure or a signal ends with one line naming what failed (which actor, the original
exception) or the signal, where the newest checkpoint is, and its exit code: 1 for a failed or dead actor,
130 for SIGINT, 143 for SIGTERM. Before, an actor's failure ended the driver with Ray's whole traceback, Ctrl-C
with a KeyboardInterrupt traceback and exit code 1, and SIGTERM aborted the driver (exit -6: Ray's C++
handler) without the cleanup in `run_training`. The real-process versions are in tests/test_grpo_e2e.py."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from pathlib import Path

import pytest
import ray.exceptions
from ray.core.generated.common_pb2 import ActorDiedErrorContext

import grpo_app.main as cli
from grpo_app import cluster
from grpo_app.checkpoint import CheckpointManager
from grpo_app.config import load_config
from rl_core.checkpoint_io import DiskFullError
from rollout.environments import RewardFailureError

APP = Path(__file__).resolve().parents[1]  # apps/grpo: `python apps/grpo` runs the trainer
ACTOR_ID = "219c713806fdc03a988613f401000000"
WORKER_TRACEBACK = ('Traceback (most recent call last):\n  File "grpo_app/workers.py", line 112, in train\n'
                    '    metrics = self.engine.train_batch(batch, loss_fn)\nRuntimeError: loss is NaN at micro-batch 3\n')


def task_error() -> ray.exceptions.RayTaskError:
    """What ray.get raises when PolicyWorker.train raised, as Ray builds it."""
    error = ray.exceptions.RayTaskError("PolicyWorker.train", WORKER_TRACEBACK,
                                        RuntimeError("loss is NaN at micro-batch 3"),
                                        proctitle="ray::PolicyWorker.train", pid=4242, ip="127.0.0.1",
                                        actor_repr="<grpo_app.workers.PolicyWorker object>", actor_id=ACTOR_ID)
    return error.as_instanceof_cause()


def died_error() -> ray.exceptions.ActorDiedError:
    """What ray.get raises when the actor's process was SIGKILLed (or OOM-killed) mid-call."""
    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        class_name="PolicyWorker", actor_id=bytes.fromhex(ACTOR_ID), pid=4242, node_ip_address="127.0.0.1",
        error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"))


@pytest.fixture()
def stopped_run(tmp_path, monkeypatch, caplog):
    """`main` on a run whose training raises `exc`; returns (exit code, the last error line)."""
    monkeypatch.setitem(cluster.ROLES, ACTOR_ID, "policy rank 1")

    def run(exc: BaseException) -> tuple[int, str]:
        def run_training(*args):
            (tmp_path / "run/checkpoints/step_4").mkdir(parents=True)  # published: complete (renamed into place)
            (tmp_path / "run/checkpoints/.step_6.tmp-abc").mkdir()  # a save the stop cut short: no checkpoint
            raise exc

        monkeypatch.setattr(cli, "run_training", run_training)
        with caplog.at_level(logging.ERROR, logger="grpo"):
            code = cli.main(["grpo.max_steps=8", f"logger.log_dir={tmp_path / 'run'}"])
        return code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR][-1]

    return run


def test_an_actor_that_raised_is_named_with_the_original_exception(stopped_run, tmp_path):
    code, line = stopped_run(task_error())
    assert code == 1
    assert line == ("run stopped: policy rank 1 (pid 4242) failed in PolicyWorker.train: RuntimeError: loss is NaN at "
                    f"micro-batch 3; the same command resumes from {tmp_path}/run/checkpoints/step_4")


def test_an_actor_that_died_is_named(stopped_run):
    code, line = stopped_run(died_error())
    assert code == 1
    assert line.startswith("run stopped: policy rank 1 (pid 4242) died: its process exited unexpectedly")


@pytest.mark.parametrize("exc, code, name", [(KeyboardInterrupt(), 130, "interrupted (SIGINT)"),
                                             (cli.Terminated(), 143, "terminated (SIGTERM)")])
def test_a_signal_stops_the_run_with_its_exit_code(stopped_run, tmp_path, exc, code, name):
    assert stopped_run(exc) == (code, f"run stopped: {name}; the same command resumes from "
                                      f"{tmp_path}/run/checkpoints/step_4")


def test_ctrl_c_while_the_config_is_checked_is_one_line_and_exit_130(monkeypatch, caplog):
    """The first seconds (config, preflight: imports of torch and sympy): a KeyboardInterrupt traceback, exit 1."""
    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "preflight", interrupted)
    with caplog.at_level(logging.ERROR, logger="grpo"):
        assert cli.main(["grpo.max_steps=2"]) == 130
    assert caplog.records[-1].getMessage().startswith("run stopped: interrupted (SIGINT) while checking the config")


def test_ctrl_c_while_ray_starts_stops_what_it_started(monkeypatch, tmp_path):
    """A Ctrl-C inside ray.init left Ray's agents running (and the driver could crash at exit): Ray is stopped."""
    stopped = []

    def start_ray(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster, "start_ray", start_ray)
    monkeypatch.setattr(cluster, "stop_ray", lambda: stopped.append(True))
    cfg = load_config(None, [f"logger.log_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt):
        cli.run_training(cfg, None)
    assert stopped == [True]


def test_a_broken_reward_function_stops_the_run_with_the_same_line(stopped_run, tmp_path):
    """As every other stop: `run stopped: ...` and where the same command resumes from (it used to be the bare
    reward message, with no word on the checkpoints)."""
    code, line = stopped_run(RewardFailureError("16 of 16 reward calls failed"))
    assert code == 1
    assert line == ("run stopped: 16 of 16 reward calls failed; the same command resumes from "
                    f"{tmp_path}/run/checkpoints/step_4")


def test_a_checkpoint_that_fills_the_disk_stops_the_run_with_one_line_naming_it(stopped_run, tmp_path, monkeypatch):
    """A checkpoint save on a full disk: the line names the disk, what a checkpoint takes and the ways to make room,
    instead of torch's 'unexpected pos 704 vs 598' from a worker's traceback; nothing of the new one is left."""
    root = tmp_path / "elsewhere/checkpoints"  # checkpointing.dir: not the run's, where stopped_run has its own
    manager = CheckpointManager(root, keep_top_k=2, metric="val/reward_mean", higher_is_better=True)
    manager.save(4, lambda path: (Path(path).mkdir(), (Path(path) / "model.pt").write_bytes(b"w" * 3 * 2**20)),
                 {"step": 4})

    def save_engine(path: str) -> None:  # what a policy rank's save does on a full disk
        Path(path).mkdir()
        (Path(path) / "model.pt").write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def disk_usage(path):  # full while the partial files hold the space
        return types.SimpleNamespace(total=2**30, free=4096 if any(root.glob(".step_6.tmp-*/*/*")) else 2**29)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    with pytest.raises(DiskFullError) as caught:
        manager.save(6, save_engine, {"step": 6})
    assert manager.steps() == [4] and not list(root.glob(".step_6*"))
    monkeypatch.undo()
    code, line = stopped_run(caught.value)
    assert code == 1
    assert line == (f"run stopped: checkpoint {root}/step_6: no space left on the filesystem of {root} (0.0 MiB free "
                    "of 1.0 GiB) while step_6 was written (RuntimeError): nothing was published, and the partial files "
                    "are removed. Each checkpoint takes about 3.0 MiB (step_4), and as one is written up to "
                    "checkpointing.keep_top_k + 2 = 4 are on the disk (the best, the latest, the new one). Free space "
                    "there, lower checkpointing.keep_top_k, or set checkpointing.dir to a larger disk; the same command "
                    f"resumes from {tmp_path}/run/checkpoints/step_4")


def test_an_unexpected_error_ends_with_its_traceback_and_the_same_line(stopped_run, tmp_path, caplog):
    """A broken plug-in contract (here the check TokenBatch makes) or a bug: the traceback, then `run stopped: ...`
    with the resume hint, exit 1 (it was a bare traceback)."""
    code, line = stopped_run(ValueError("TokenBatch.ref_logprobs[0] has shape (9,); expected (10,)\nmore"))
    assert code == 1
    assert line == ("run stopped: ValueError: TokenBatch.ref_logprobs[0] has shape (9,); expected (10,); the same "
                    f"command resumes from {tmp_path}/run/checkpoints/step_4")
    assert any(r.exc_info for r in caplog.records)  # the traceback, for whoever fixes it


def test_an_actor_that_failed_to_start_is_named():
    cluster.ROLES[ACTOR_ID] = "generation worker 0"
    try:
        error = ray.exceptions.ActorDiedError(ray.exceptions.RayTaskError(
            "GenerationWorker.__init__", "Traceback (most recent call last):\nOSError: no such model\n",
            OSError("no such model"), proctitle="ray::GenerationWorker.__init__", pid=7, ip="127.0.0.1",
            actor_repr="<GenerationWorker>", actor_id=ACTOR_ID))
        assert cluster.describe_failure(error) == "generation worker 0 failed to start: OSError: no such model"
    finally:
        del cluster.ROLES[ACTOR_ID]


def test_sigterm_raises_in_the_main_thread_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(cli.Terminated), cli.signals_stop_the_run():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal ends the sleep: its handler raises here
    assert signal.getsignal(signal.SIGTERM) is before



def test_only_the_first_signal_raises_and_the_cleanup_runs_to_its_end(caplog):
    """SIGTERM stops the run; a Ctrl-C and another SIGTERM during its cleanup neither interrupt it nor change the
    exit (Terminated: 143), and are answered with one warning; a signal during the cleanup of a run that ended
    by itself raises nothing. Before, the second signal raised inside the cleanup (in ray.shutdown, say). The
    handlers are then the ones from before (not necessarily Python's default: whatever this process had)."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cleaned = []
    with caplog.at_level(logging.WARNING, logger="grpo"), pytest.raises(cli.Terminated):
        with cli.signals_stop_the_run():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the signal ends the sleep: its handler raises here
            finally:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
                cleaned.append(True)
    assert cleaned == [True]
    assert [r.getMessage() for r in caplog.records] == [
        "SIGINT: the run is already stopping; it ends once its workers and Ray are shut down (seconds)"]
    with cli.signals_stop_the_run() as stop:
        stop.cleaning_up = True
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before

WAITS_ON_RAY = textwrap.dedent('''
    import sys, time

    import ray

    from grpo_app.cluster import start_ray
    from grpo_app.config import load_config
    from grpo_app.main import Terminated, signals_stop_the_run

    start_ray(load_config(None, ["cluster.num_cpus=1"]))

    @ray.remote(num_cpus=0)
    def generate_forever():
        time.sleep(600)

    ref = generate_forever.remote()
    try:
        with signals_stop_the_run():
            print("waiting", flush=True)
            ray.wait([ref])  # as the loop waits for the generators (cluster.generate_by_replica)
    except Terminated:
        print("terminated", flush=True)
        sys.exit(143)
''')


def test_sigterm_stops_a_driver_blocked_in_ray_wait(tmp_path):
    """The driver waiting on a generation (ray.wait) gets SIGTERM: it stops within seconds. Before, with no
    handler, Ray's C++ handler aborted it (exit -6); with a handler raising anything but KeyboardInterrupt,
    Ray dropped the exception inside the wait and the run went on until the generation returned."""
    script = tmp_path / "waits_on_ray.py"
    script.write_text(WAITS_ON_RAY)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        time.sleep(1.0)  # inside ray.wait
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(timeout=60) == 143
        assert time.monotonic() - start < 15
        assert proc.stdout.read() == "terminated\n"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_signals_during_the_cleanup_leave_one_line_exit_130_and_nothing_behind(tmp_path):
    """Ctrl-C mid-run, then SIGTERM and Ctrl-C in turn every 0.25 s until the driver exits, so that one lands in
    each part of the cleanup (closing the reward pools, killing the actors, ray.shutdown, the interpreter's exit):
    the run still ends with one `run stopped: interrupted (SIGINT)` line and exit code 130, no traceback, every
    process it started gone and no reward scratch directory left. Before: a second Ctrl-C raised inside
    ray.shutdown (a traceback, exit -11, Ray's agents left running), a SIGTERM after it killed the driver (-15:
    Ray resets SIGTERM as it shuts down), and ray.kill left every reward pool's directory for the next run."""
    import psutil

    log_dir, log, temp = tmp_path / "run", tmp_path / "run.log", tmp_path / "tmp"
    temp.mkdir()
    overrides = ["grpo.max_steps=1000", "grpo.val_every=0", "checkpointing.enabled=false", "logger.plot=false",
                 "logger.tensorboard=false", "logger.progress_bar=false", f"logger.log_dir={log_dir}"]
    # the run's reward pool directory under TMPDIR (tempfile); Ray's session where it would be (its socket paths
    # would outgrow the 107 bytes of AF_UNIX under tmp_path)
    env = {**os.environ, "TMPDIR": str(temp), "RAY_TMPDIR": tempfile.gettempdir()}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(APP), *overrides], env=env, stdout=out, stderr=out,
                                start_new_session=True)
    try:
        deadline = time.time() + 120
        metrics = log_dir / "metrics.jsonl"
        while not (metrics.exists() and "train/loss" in metrics.read_text()):  # mid-run: a step is done
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        driver = psutil.Process(proc.pid)
        started = [driver, *driver.children(recursive=True)]  # Ray's GCS, raylet, workers, the reward pool
        assert list(temp.glob("reward-pool-*")), "the run's reward pool has no directory under TMPDIR"
        for signum in [signal.SIGINT] + [signal.SIGTERM, signal.SIGINT] * 40:
            if proc.poll() is not None:
                break
            proc.send_signal(signum)
            time.sleep(0.25)
        assert proc.wait(timeout=60) == 130, log.read_text()[-3000:]
        output = log.read_text()
        stop_lines = [line for line in output.splitlines() if "run stopped:" in line]
        assert len(stop_lines) == 1 and "run stopped: interrupted (SIGINT)" in stop_lines[0], output[-3000:]
        assert output.rstrip().endswith(stop_lines[0]) and "Traceback" not in output, output[-3000:]
        _, alive = psutil.wait_procs(started, timeout=20)
        assert not alive, [" ".join(p.cmdline()) for p in alive]
        assert not list(temp.glob("reward-pool-*"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start_workers(rank: int, world_size: int, cfg) -> str:
    """Workers(cfg) on a local Ray in this (spawned) process: the error it raises, as text."""
    cluster.start_ray(cfg)
    try:
        cluster.Workers(cfg)
    except ray.exceptions.RayError as exc:
        return type(exc).__name__
    finally:
        cluster.stop_ray()
    return "started"


def test_a_start_that_fails_closes_the_reward_pools_it_started(tmp_path, monkeypatch):
    """A policy rank that cannot start (here: its model directory is gone) fails the run's start after the reward
    worker has opened its scoring pool; what did start is shut down, and the pool's scratch directory is removed
    (before, it was left for the next run on the node to remove; a Ctrl-C during the start did the same). The
    driver is a spawned process: Ray started in the test process would leave threads that later forked tests'
    ranks can deadlock on."""
    import dataclasses
    import shutil

    from grpo_app.config import load_config
    from grpo_app.preflight import preflight
    from rl_core.testing.distributed import run_distributed

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the reward worker's pool directory (tempfile), as Ray's workers inherit
    monkeypatch.setenv("RAY_TMPDIR", tempfile.gettempdir())  # Ray's session where it would be (socket path length)
    model = tmp_path / "model"
    cfg = preflight(load_config(None, ["env.num_workers=1", f"logger.log_dir={tmp_path / 'run'}"]))
    shutil.copytree(cfg.policy.model_name, model)
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, model_name=str(model)))
    (model / "model.safetensors").unlink()  # preflight passed: the workers find it missing
    (outcome,) = run_distributed(_start_workers, world_size=1, args=(cfg,), start_method="spawn")
    assert outcome != "started"  # the policy rank's failure came out of Workers(cfg) as a Ray error
    assert not list(temp.glob("reward-pool-*"))


def test_a_second_run_in_the_same_directory_is_refused(tmp_path, caplog, monkeypatch):
    """Two runs on one logger.log_dir wrote the same metrics and checkpoints; the second now stops before Ray, naming
    the first. The lock goes with the process that held it: the next run starts."""
    from grpo_app.run_lock import hold_run_dir

    ran = []
    monkeypatch.setattr(cli, "run_training", lambda *args: ran.append(True))
    argv = ["grpo.max_steps=2", f"logger.log_dir={tmp_path / 'run'}"]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, pathlib\n"
                               "from grpo_app.run_lock import hold_run_dir\n"
                               f"with hold_run_dir(pathlib.Path({str(tmp_path / 'run')!r})):\n"
                               "    print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with caplog.at_level(logging.ERROR, logger="grpo"):
            assert cli.main(argv) == 2
        assert f"logger.log_dir={tmp_path / 'run'} is in use by another run (pid {holder.pid} on " in caplog.text
        assert not ran
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(argv) == 0 and ran == [True]
    with hold_run_dir(tmp_path / "run"):  # released by the run that ended
        pass


def test_a_complete_run_started_again_says_so_without_starting_ray(tmp_path, caplog, monkeypatch):
    """It took ~30 s of Ray and workers, validated again and exited 0 without a word on the run being complete."""
    from grpo_app.checkpoint import ResumePoint

    ran = []
    monkeypatch.setattr(cli, "run_training", lambda *args: ran.append(True))
    point = ResumePoint(tmp_path / "run/checkpoints/step_2", {"step": 2})
    monkeypatch.setattr(cli, "find_resume_point", lambda cfg, damaged: point)
    monkeypatch.setattr(cli, "check_prompts", lambda *args, **kwargs: None)
    with caplog.at_level(logging.INFO, logger="grpo"):
        assert cli.main(["grpo.max_steps=2", f"logger.log_dir={tmp_path / 'run'}"]) == 0
    assert not ran and f"the run in {tmp_path / 'run'} is complete: {point.path} is step 2 of grpo.max_steps=2" \
        in caplog.text
    assert cli.main(["grpo.max_steps=3", f"logger.log_dir={tmp_path / 'run'}"]) == 0 and ran == [True]  # trains on
