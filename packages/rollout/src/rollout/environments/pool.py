"""`RewardPool`: run a reward function in sandboxed worker subprocesses under a time limit.

Owns process management only: a crashed worker (segfault, os._exit, OOM kill) is replaced and that one
call scores an error; a call that overruns the limit is killed the same way, until a batch has had as many
overruns as the pool has workers, which ends it (see `RewardPool`). Each worker runs
in a session (process group) of its own, and killing a worker kills the group: processes a reward
function started (a code-execution reward's program) go with it. Which function runs and how results
become `RewardResult`s is rollout.environments.base's business; what confines a worker (memory, files,
network) is rollout._sandbox's.

Workers are started with `spawn` (no inherited torch threads or CUDA state). A spawned worker re-imports
the caller's `__main__` module (torch, in a trainer script) before rollout._reward_worker and the reward
function, so a replacement takes seconds: it starts in the background while the live workers go on
scoring, and its startup counts against no call's time limit.

Scratch files: each pool owns one directory `reward-pool-*` in the system temp dir (a scratch subdirectory
per worker) and holds an exclusive `flock` on a lock file in it for its lifetime. The directory goes with
`close()`, at interpreter exit, and, when the owning process was killed (SIGKILL, OOM: the kernel drops
the lock), with the next pool started on that machine, which removes every pool directory whose lock it
can take. Nothing keys on process ids, so pools in other containers sharing the temp dir are left alone.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from rollout._reward_worker import worker_main

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
POOL_DIR_PREFIX = "reward-pool-"
LOCK_NAME = ".lock"


@dataclass
class CallOutcome:
    """One call's outcome: status is 'ok', 'error' (raised / bad value), 'timeout' or 'crash'."""

    status: str
    reward: float = 0.0
    correct: bool | None = None
    message: str | None = None


class _Worker:
    """A worker process, started without waiting for it: `ready` once it has reported its startup."""

    def __init__(self, ctx: Any, fn_path: str, kwargs: dict[str, Any], memory_limit_mb: int | None,
                 pool_dir: str) -> None:
        self.scratch = tempfile.mkdtemp(prefix="worker-", dir=pool_dir)
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, daemon=True,
                                   args=(child, fn_path, kwargs, self.scratch, memory_limit_mb, os.getcwd()))
        self.process.start()
        child.close()
        self.fn_path = fn_path
        self.started = time.monotonic()
        self.ready = False
        self.sandbox: list[str] = []

    @property
    def startup_deadline(self) -> float:
        return self.started + STARTUP_TIMEOUT_S

    def finish_start(self) -> None:
        """Read the startup report (call when `conn` is readable); ValueError if the import failed."""
        try:
            status, message = self.conn.recv()
        except (EOFError, OSError):
            status, message = "init_error", f"reward worker for {self.fn_path!r} exited while starting"
        if status == "init_error":
            self.kill()
            raise ValueError(message)
        self.sandbox, self.ready = message, True

    def wait_ready(self) -> _Worker:
        """Block until the worker imported the function; ValueError if the import failed."""
        if self.ready:
            return self
        if not self.conn.poll(max(0.0, self.startup_deadline - time.monotonic())):
            self.kill()
            raise RuntimeError(f"reward worker for {self.fn_path!r} did not start within {STARTUP_TIMEOUT_S} s")
        self.finish_start()
        return self

    def kill(self) -> None:
        """Kill the worker and every process of its group (what the reward function started)."""
        try:
            # The group id is the worker's pid only once the worker has called setsid(); before that no
            # such group exists (ESRCH), so this never reaches the caller's own group.
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _create_pool_dir() -> tuple[str, int]:
    """A fresh pool directory and the descriptor of its lock, already held. The lock file is locked under a
    temporary name and then renamed, so a reaper never finds `.lock` unlocked in a live pool's directory."""
    path = tempfile.mkdtemp(prefix=POOL_DIR_PREFIX)
    fd = os.open(os.path.join(path, LOCK_NAME + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(os.path.join(path, LOCK_NAME + ".new"), os.path.join(path, LOCK_NAME))
    return path, fd


def _remove_pool_dir(path: str, lock_fd: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)


def remove_orphaned_pool_dirs() -> int:
    """Remove the directories of pools whose process is gone (their lock is free); returns how many."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(POOL_DIR_PREFIX + "*"):
        try:
            fd = os.open(path / LOCK_NAME, os.O_RDWR)
        except OSError:  # not a pool directory of ours, or one still being created
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its pool is alive
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)  # under the lock: a concurrent reaper skips it
        os.close(fd)
        removed += 1
    return removed


def check_pool_options(*, num_workers: int = 2, timeout_s: float = 10.0, memory_limit_mb: int | None = 4096) -> None:
    """ValueError for a pool setting out of range (the trainer's preflight calls it on env.kwargs before Ray)."""
    if num_workers < 0:
        raise ValueError(f"reward num_workers={num_workers}; expected >= 0 (0 is read as 1)")
    if not timeout_s > 0:
        raise ValueError(f"reward timeout_s={timeout_s}; expected > 0 seconds")
    if memory_limit_mb is not None and memory_limit_mb < 64:
        raise ValueError(f"reward memory_limit_mb={memory_limit_mb}; expected >= 64 (or None: no limit)")


class RewardPool:
    """`num_workers` sandboxed subprocesses (rollout._sandbox) running `fn_path` (pkg.module:function).

    Time limit: each call gets `timeout_s` from when a worker takes it. A call that overruns it scores a
    timeout and its worker is killed and replaced, the batch going on (a reward that hangs on one
    pathological completion, as math parsers can, costs that call alone). Once a batch has had as many
    overruns as there are workers (at least 2), the function is taken to hang on everything: every busy
    worker is killed and the calls not yet scored fail as timeouts, so such a function costs about
    `timeout_s` per batch (2 x `timeout_s` and a worker start with one worker), not per call. A
    replacement starts in the background; calls wait for a live worker meanwhile.
    `num_workers=0` is read as 1: a reward function never runs in the calling process, where a hung call
    could not be stopped.
    """

    def __init__(self, fn_path: str, *, num_workers: int = 2, timeout_s: float = 10.0,
                 fn_kwargs: dict[str, Any] | None = None, memory_limit_mb: int | None = 4096) -> None:
        check_pool_options(num_workers=num_workers, timeout_s=timeout_s, memory_limit_mb=memory_limit_mb)
        self.fn_path, self.num_workers, self.timeout_s = fn_path, max(num_workers, 1), timeout_s
        self.fn_kwargs, self.memory_limit_mb = dict(fn_kwargs or {}), memory_limit_mb
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        orphans = remove_orphaned_pool_dirs()
        if orphans:
            logger.info("removed %d reward pool directories left by killed runs", orphans)
        self.dir, lock_fd = _create_pool_dir()
        # at close(), garbage collection or interpreter exit, whichever comes first
        self._remove_dir = weakref.finalize(self, _remove_pool_dir, self.dir, lock_fd)
        self._ensure_workers()  # a bad import path fails here, at setup, not in the first step
        logger.info("reward pool for %s: %d sandboxed worker(s) (%s)", fn_path, self.num_workers,
                    ", ".join(self.sandbox))

    @property
    def sandbox(self) -> list[str]:
        """The confinement layers that hold in the workers (see rollout._sandbox)."""
        return next((w.sandbox for w in self._workers if w.ready), [])

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._ctx, self.fn_path, self.fn_kwargs, self.memory_limit_mb, self.dir)
        self._workers.append(worker)
        return worker

    def _ensure_workers(self) -> None:
        """Start the missing workers and wait for every one (replacements a previous batch started too)."""
        for _ in range(self.num_workers - len(self._workers)):
            self._start_worker()
        try:
            for worker in self._workers:  # started together: imports (sympy for math-verify: seconds) overlap
                worker.wait_ready()
        except Exception:
            for worker in self._workers:
                if not worker.ready:
                    worker.kill()
            self._workers = [w for w in self._workers if w.ready]
            raise

    def run(self, calls: Sequence[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> list[CallOutcome]:
        """Score (prompt, completion, metadata, optional fields) calls; one outcome per call, in order. The optional
        fields (rollout._reward_worker.OPTIONAL_FIELDS, e.g. finish_reason) reach the function where it takes them."""
        if not self._remove_dir.alive:
            raise RuntimeError(f"reward pool for {self.fn_path!r} is closed; create a new one")
        self._ensure_workers()
        results: list[CallOutcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        idle = list(self._workers)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        starting: dict[Connection, _Worker] = {}  # replacements of crashed workers, not ready yet
        overruns = 0
        while pending or busy:
            while pending and idle:
                worker, task = idle.pop(), pending.popleft()
                try:
                    worker.conn.send((task, *calls[task]))
                except OSError:  # it died while idle (OOM kill between batches): the call was never sent
                    pending.appendleft(task)
                    fresh = self._replace(worker)
                    starting[fresh.conn] = fresh
                    continue
                busy[worker.conn] = (worker, task, time.monotonic() + self.timeout_s)
            if not busy and not starting:  # every worker died and no replacement could start
                for task in pending:
                    results[task] = CallOutcome("crash", message="no reward worker could be restarted")
                break
            next_deadline = min([d for _, _, d in busy.values()] + [w.startup_deadline for w in starting.values()])
            for conn in wait(list(busy) + list(starting), timeout=max(0.0, next_deadline - time.monotonic())):
                if conn in starting:
                    self._finish_replacement(starting.pop(conn), idle)
                    continue
                worker, task, _ = busy.pop(conn)
                try:
                    _, payload = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=2)  # EOF can arrive before the exit status
                    code = worker.process.exitcode
                    results[task] = CallOutcome("crash", message=f"reward worker died (exit code {code})")
                    fresh = self._replace(worker)
                    starting[fresh.conn] = fresh
                    continue
                results[task] = self._outcome(payload)
                idle.append(worker)
            now = time.monotonic()
            # A result (or a crash) already waiting in the pipe is read on the next pass, not called late.
            late = [conn for conn, (_, _, deadline) in busy.items() if now >= deadline and not conn.poll()]
            overruns += len(late)
            if late and overruns >= max(2, self.num_workers):
                self._end_batch(busy[late[0]][1], busy, pending, results)
                late = []
            for conn in late:
                worker, task, _ = busy.pop(conn)
                results[task] = CallOutcome("timeout", message=f"reward call {task} of this batch exceeded "
                                                               f"{self.timeout_s} s; its worker was replaced")
                fresh = self._replace(worker, "timed out")
                starting[fresh.conn] = fresh
            for conn, worker in list(starting.items()):
                if now >= worker.startup_deadline and not conn.poll():
                    del starting[conn]
                    self._drop(worker, f"did not start within {STARTUP_TIMEOUT_S} s")
        return [r if r is not None else CallOutcome("error", message="no result") for r in results]

    def _end_batch(self, late: int, busy: dict[Connection, tuple[_Worker, int, float]], pending: deque,
                   results: list[CallOutcome | None]) -> None:
        """Call `late` overran the limit: kill every busy worker and fail what is left of the batch."""
        message = f"reward call {late} of this batch exceeded {self.timeout_s} s; the rest of the batch is skipped"
        for worker, task, _ in busy.values():
            worker.kill()
            self._workers.remove(worker)
            results[task] = CallOutcome("timeout", message=message)
        for task in pending:
            results[task] = CallOutcome("timeout", message=message)
        busy.clear()
        pending.clear()
        logger.warning("%s (%s)", message, self.fn_path)

    @staticmethod
    def _outcome(payload: tuple) -> CallOutcome:
        if payload[0] == "ok":
            return CallOutcome("ok", reward=payload[1], correct=payload[2])
        return CallOutcome("error", message=payload[1])

    def _replace(self, worker: _Worker, why: str = "crashed") -> _Worker:
        """Kill a crashed (or overrunning) worker and start its replacement without waiting for it (see `run`)."""
        worker.kill()
        self._workers.remove(worker)
        logger.warning("replacing %s reward worker for %s", why, self.fn_path)
        return self._start_worker()

    def _finish_replacement(self, worker: _Worker, idle: list[_Worker]) -> None:
        try:
            worker.finish_start()
        except ValueError as exc:
            self._drop(worker, str(exc))
            return
        idle.append(worker)

    def _drop(self, worker: _Worker, why: str) -> None:
        """A replacement that failed to start; the next batch starts another (and raises if that fails too)."""
        worker.kill()
        self._workers.remove(worker)
        logger.error("replacement reward worker for %s failed: %s", self.fn_path, why)

    def close(self) -> None:
        """Stop every worker and remove the pool's directory; the pool cannot run again."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=1)
            worker.kill()
        self._workers = []
        self._remove_dir()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass
