"""`RewardPool`: run a reward function in worker subprocesses, each call under a time limit.

Owns process management only: a crashed worker (segfault, os._exit, OOM kill) or one that overruns the
per-call limit is killed and replaced, and that one call scores an error; the batch goes on. Which
function runs and how results become `RewardResult`s is rollout.environments.base's business.

Workers are started with `spawn` (no inherited torch threads or CUDA state) and import only
rollout._reward_worker plus the reward function, so a replacement starts in well under a second.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rollout._reward_worker import call_reward, resolve_function, worker_main

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0


@dataclass
class CallOutcome:
    """One call's outcome: status is 'ok', 'error' (raised / bad value), 'timeout' or 'crash'."""

    status: str
    reward: float = 0.0
    correct: bool | None = None
    message: str | None = None


class _Worker:
    def __init__(self, ctx: Any, fn_path: str, kwargs: dict[str, Any]) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, fn_path, kwargs), daemon=True)
        self.process.start()
        child.close()
        self.fn_path = fn_path

    def wait_ready(self) -> _Worker:
        """Block until the worker imported the function; ValueError if the import failed."""
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"reward worker for {self.fn_path!r} did not start within {STARTUP_TIMEOUT_S} s")
        try:
            status, message = self.conn.recv()
        except EOFError:
            status, message = "init_error", f"reward worker for {self.fn_path!r} exited while starting"
        if status == "init_error":
            self.kill()
            raise ValueError(message)
        return self

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`num_workers` subprocesses running `fn_path` (pkg.module:function); 0 = in-process, no time limit."""

    def __init__(self, fn_path: str, *, num_workers: int = 2, timeout_s: float = 10.0,
                 fn_kwargs: dict[str, Any] | None = None) -> None:
        if num_workers < 0:
            raise ValueError(f"reward num_workers={num_workers}; expected >= 0 (0 runs rewards in-process)")
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s={timeout_s}; expected > 0 seconds")
        self.fn_path, self.num_workers, self.timeout_s = fn_path, num_workers, timeout_s
        self.fn_kwargs = dict(fn_kwargs or {})
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._local_fn = resolve_function(fn_path) if num_workers == 0 else None
        self._ensure_workers()  # a bad import path fails here, at setup, not in the first step

    def _ensure_workers(self) -> None:
        # Start all, then wait for all: imports (sympy for math-verify: seconds) overlap.
        fresh = [_Worker(self._ctx, self.fn_path, self.fn_kwargs) for _ in range(self.num_workers - len(self._workers))]
        try:
            ready = [w.wait_ready() for w in fresh]
        except Exception:
            for w in fresh:
                w.kill()
            raise
        self._workers.extend(ready)

    def run(self, calls: Sequence[tuple[str, str, dict[str, Any]]]) -> list[CallOutcome]:
        """Score (prompt, completion, metadata) triples; one outcome per call, in order."""
        if self._local_fn is not None:
            return [self._outcome(call_reward(self._local_fn, self.fn_kwargs, *c)) for c in calls]
        self._ensure_workers()
        results: list[CallOutcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        idle = list(self._workers)
        busy: dict[Connection, tuple[_Worker, int, float]] = {}
        while pending or busy:
            while pending and idle:
                worker, task = idle.pop(), pending.popleft()
                worker.conn.send((task, *calls[task]))
                busy[worker.conn] = (worker, task, time.monotonic() + self.timeout_s)
            next_deadline = min(deadline for _, _, deadline in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker, task, _ = busy.pop(conn)
                try:
                    _, payload = conn.recv()
                except (EOFError, OSError):
                    worker.process.join(timeout=2)  # EOF can arrive before the exit status
                    code = worker.process.exitcode
                    results[task] = CallOutcome("crash", message=f"reward worker died (exit code {code})")
                    idle.append(self._replace(worker))
                    continue
                results[task] = self._outcome(payload)
                idle.append(worker)
            now = time.monotonic()
            for conn, (worker, task, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[conn]
                    results[task] = CallOutcome("timeout", message=f"reward call exceeded {self.timeout_s} s")
                    idle.append(self._replace(worker))
        return [r if r is not None else CallOutcome("error", message="no result") for r in results]

    @staticmethod
    def _outcome(payload: tuple) -> CallOutcome:
        if payload[0] == "ok":
            return CallOutcome("ok", reward=payload[1], correct=payload[2])
        return CallOutcome("error", message=payload[1])

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._ctx, self.fn_path, self.fn_kwargs).wait_ready()
        self._workers[self._workers.index(worker)] = fresh
        logger.warning("replaced reward worker for %s (crash or timeout)", self.fn_path)
        return fresh

    def close(self) -> None:
        """Stop every worker."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=1)
            worker.kill()
        self._workers = []

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing useful to do
            pass
