"""A run that stops on a failure or a signal ends with one line naming what failed (which actor, the original
exception) or the signal, where the newest checkpoint is, and its exit code: 1 for a failed or dead actor,
130 for SIGINT, 143 for SIGTERM. Before, an actor's failure ended the driver with Ray's whole traceback, Ctrl-C
with a KeyboardInterrupt traceback and exit code 1, and SIGTERM aborted the driver (exit -6: Ray's C++
handler) without the cleanup in `run_training`. The real-process versions are in tests/test_grpo_e2e.py."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import ray.exceptions
from ray.core.generated.common_pb2 import ActorDiedErrorContext

import grpo_app.main as cli
from grpo_app import cluster

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
    with pytest.raises(cli.Terminated), cli.sigterm_stops_the_run():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal ends the sleep: its handler raises here
    assert signal.getsignal(signal.SIGTERM) is before


WAITS_ON_RAY = textwrap.dedent('''
    import sys, time

    import ray

    from grpo_app.cluster import start_ray
    from grpo_app.config import load_config
    from grpo_app.main import Terminated, sigterm_stops_the_run

    start_ray(load_config(None, ["cluster.num_cpus=1"]))

    @ray.remote(num_cpus=0)
    def generate_forever():
        time.sleep(600)

    ref = generate_forever.remote()
    try:
        with sigterm_stops_the_run():
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
