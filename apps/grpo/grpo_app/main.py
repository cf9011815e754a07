"""The trainer's run: `uv run apps/grpo [--config FILE] [dotted.key=value ...]` (the command line: grpo_app.cli).

Parses and validates the whole config, checks inputs before any worker starts, builds the run,
resumes from the newest intact checkpoint in the run directory if there is one, trains, and logs a summary.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import yaml

from grpo_app.build import RunInputs, checkpoint_manager, find_resume_point, load_inputs
from grpo_app.checkpoint import DamagedOnLoad, ResumePoint, check_prompts
from grpo_app.cli import main  # noqa: F401  (the whole command, for scripts and tests: main(argv) -> exit code)
from grpo_app.config import GRPOConfig
from grpo_app.preflight import preflight
from grpo_app.run_lock import hold_run_dir
from rl_core.checkpoint_io import DiskFullError
from rl_core.config import ConfigError, to_dict
from rollout.environments.base import RewardFailureError

logger = logging.getLogger("grpo")
class Terminated(BaseException):
    """The run got SIGTERM (main: exit 143); a BaseException, as KeyboardInterrupt, so that no `except
    Exception` on the way up takes it for an error of its own."""


@dataclass
class StopState:
    """`first`: the signal that stopped the run (it sets the exit code). From then on, and from `cleaning_up` on,
    a signal does not raise: `warned` once it has been answered. `save_requested`: SIGUSR1 came (the loop saves a
    checkpoint after the step it is in and stops)."""

    first: int | None = None
    cleaning_up: bool = False
    warned: bool = False
    save_requested: bool = False


@contextlib.contextmanager
def signals_stop_the_run() -> Iterator[StopState]:
    """Once Ray runs, SIGTERM ends the run as Ctrl-C does: the `finally` blocks kill the actors and close the
    metrics files, and `Terminated` comes out. Without it, the C++ handler ray.init installs aborts the driver
    (exit -6, a stack dump, no cleanup). Call after ray.init, which replaces any earlier handler.

    Only the first SIGINT / SIGTERM raises, and it sets the exit code. A later one, or one during the cleanup, lets
    the cleanup finish: raised inside it (in ray.shutdown, say), a second Ctrl-C printed a traceback, could crash
    the driver (exit -11) and left Ray's agents and the reward scratch directories behind. Not "stop faster": the
    cleanup is bounded (cluster.REWARD_CLOSE_TIMEOUT_S for the reward workers, then ~1.5 s of ray.shutdown), and
    what a faster stop would skip is what leaves processes or directories behind; SIGKILL still ends it at once.

    SIGUSR1 interrupts nothing: the loop saves a checkpoint after the step in progress and stops (exit 0), the
    same command resumes. A batch job's time limit (Slurm's `--signal=B:USR1@300`) is met with the run saved,
    where SIGTERM before SIGKILL leaves seconds (as Megatron-LM's --exit-signal-handler does with its signal)."""
    state = StopState()
    if threading.current_thread() is not threading.main_thread():  # handlers belong to the main thread
        yield state
        return

    def stop(signum: int, frame: object) -> None:
        if state.first is None and not state.cleaning_up:
            state.first = signum
            # A KeyboardInterrupt, not Terminated: raised while the driver blocks in ray.wait / ray.get, Ray turns
            # a KeyboardInterrupt into one of its own and drops any other exception, and the wait goes on
            # (measured: a SIGTERM raising Terminated during a generation did not stop the run).
            raise KeyboardInterrupt
        if not state.warned:
            state.warned = True
            logger.warning("%s: the run is already stopping; it ends once its workers and Ray are shut down "
                           "(seconds)", signal.Signals(signum).name)

    def save_and_stop(signum: int, frame: object) -> None:
        state.save_requested = True

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, save_and_stop)
    try:
        yield state
    except KeyboardInterrupt:
        if state.first == signal.SIGTERM:
            raise Terminated() from None
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_training(cfg: GRPOConfig, inputs: RunInputs, resume_point: ResumePoint | None = None) -> dict[str, float]:
    """Build the workers and run the loop (from `resume_point` if given); returns the final validation metrics."""
    from grpo_app.build import build_run, resume
    from grpo_app.cluster import start_ray, stop_ray

    log_dir = Path(cfg.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    logger.info("resolved config (saved to %s):\n%s", log_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    owns_ray = not ray.is_initialized()
    try:
        start_ray(cfg)
    except BaseException:  # Ctrl-C while Ray starts: what it started so far must not outlive the driver
        if owns_ray:
            stop_ray()
        raise
    with signals_stop_the_run() as stop:
        run = None
        try:
            run = build_run(cfg, inputs, resume_point)
            from grpo_app.loop import train

            train(run, start_step=resume(run, resume_point), save_requested=lambda: stop.save_requested)
            if cfg.logger.plot:
                logger.info("plot: %s", run.sink.plot(log_dir / "summary.png"))
            logger.info("summary:\n%s", run.sink.summary())
            _, val = run.sink.series("val/reward_mean")
            return {"val_reward_first": val[0], "val_reward_last": val[-1]} if val else {}
        finally:
            stop.cleaning_up = True  # from here on a signal does not interrupt it (signals_stop_the_run)
            if run is not None:
                run.sink.close(failed=sys.exc_info()[0] is not None)  # in a finally: the exception on its way out
                run.workers.shutdown()
            if owns_ray:  # here, not in ray.init's exit hook: a signal there interrupted it (signals_stop_the_run)
                stop_ray()


def run(cfg: GRPOConfig) -> int:
    """The run of a loaded config (grpo_app.cli.main loads it); its exit code."""
    try:  # everything a run reads is checked here, before Ray or any worker starts
        cfg = preflight(cfg)
        inputs = load_inputs(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:  # nothing started yet: nothing to clean up, and no traceback from deep in an import
        logger.error("run stopped: interrupted (SIGINT) while checking the config, before anything started")
        return 130
    try:
        with hold_run_dir(Path(cfg.logger.log_dir)):
            return _train_from_newest_checkpoint(cfg, inputs)
    except ConfigError as exc:  # another run holds the directory
        logger.error("%s", exc)
        return 2


def _train_from_newest_checkpoint(cfg: GRPOConfig, inputs: RunInputs) -> int:
    """Train from the newest intact checkpoint (from the next older one when the engine finds it damaged)."""
    known_damaged: dict[Path, str] = {}  # checkpoints an engine found damaged as it loaded them
    while True:
        try:
            resume_point = find_resume_point(cfg, known_damaged)
            if resume_point is not None:
                check_prompts(resume_point, inputs.train, allow_change=cfg.checkpointing.allow_config_change)
        except (ConfigError, ValueError) as exc:  # CheckpointError is a ValueError
            logger.error("%s", exc)
            return 2
        if resume_point is not None and resume_point.step == cfg.grpo.max_steps:  # not ~30 s of Ray to learn it
            logger.info("the run in %s is complete: %s is step %d of grpo.max_steps=%d, nothing is left to train; "
                        "raise grpo.max_steps to train on, or set another logger.log_dir for a new run",
                        cfg.logger.log_dir, resume_point.path, resume_point.step, cfg.grpo.max_steps)
            return 0
        try:
            return _train(cfg, inputs, resume_point)
        except DamagedOnLoad as exc:  # Ray is down again: the next older checkpoint, as if found damaged first
            logger.warning("checkpoint %s is damaged and skipped: %s (the policy found it as it loaded it); looking "
                           "for an older checkpoint", exc.path, exc.reason)
            known_damaged[exc.path] = exc.reason


def _train(cfg: GRPOConfig, inputs: RunInputs, resume_point: ResumePoint | None) -> int:
    """`run_training`, its failures as one line and an exit code; DamagedOnLoad passes through."""
    try:
        run_training(cfg, inputs, resume_point)
    except ConfigError as exc:  # found only once Ray runs (e.g. cluster.address answers but is no Ray)
        logger.error("%s", exc)
        return 2
    except (RewardFailureError, DiskFullError) as exc:  # a broken reward function, a full disk: one line
        logger.error("run stopped: %s%s", exc, _resume_hint(cfg))
        return 1
    except ray.exceptions.RayError as exc:  # an actor raised or died: its own traceback, then one line naming it
        from grpo_app.cluster import describe_failure

        logger.error("%s", exc)
        logger.error("run stopped: %s%s", describe_failure(exc), _resume_hint(cfg))
        return 1
    except KeyboardInterrupt:
        _ignore_signals_at_exit()
        logger.error("run stopped: interrupted (SIGINT)%s", _resume_hint(cfg))
        return 130
    except Terminated:
        _ignore_signals_at_exit()
        logger.error("run stopped: terminated (SIGTERM)%s", _resume_hint(cfg))
        return 143
    except DamagedOnLoad:
        raise
    except Exception as exc:  # a bug here or in a plug-in (an engine's or backend's broken contract): its traceback,
        logger.exception("unexpected error")  # then the one line every stopped run ends with
        logger.error("run stopped: %s: %s%s", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "",
                     _resume_hint(cfg))
        return 1
    return 0


def _ignore_signals_at_exit() -> None:
    """Ignore SIGINT and SIGTERM from the first exit hook on. A run a signal stopped is cleaned up, and only the exit
    is left, whose Python teardown (~1.5 s with torch and Ray loaded) a further signal would end by that signal
    (exit -2 / -15, not 130 / 143). At exit and not now: an ignored signal is inherited by every process started
    afterwards, which would then ignore SIGTERM too (a test calling main() would hang the suite's later ones)."""
    def ignore() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)

    atexit.register(ignore)  # registered last, run first


def _resume_hint(cfg: GRPOConfig) -> str:
    """Where a stopped run would go on from: checkpoints are published complete (renamed into place), so the
    newest `step_N` is whole; a save the stop cut short left only a temporary directory, removed by the next."""
    steps = checkpoint_manager(cfg).steps() if cfg.checkpointing.enabled else []
    if not steps:
        return "; no checkpoint yet: a new run starts from step 0"
    return f"; the same command resumes from {Path(cfg.checkpoint_dir) / f'step_{steps[-1]}'}"
