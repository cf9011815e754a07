"""One training run per run directory (`logger.log_dir`).

Two runs started on one directory both appended to metrics.jsonl and TensorBoard, resumed from the same checkpoint
and wrote the same `step_N`. The driver holds an advisory lock (`flock`) on `<log_dir>/.run.lock` for the whole run:
the kernel releases it when the process ends however it ends, so a crashed run leaves no stale lock. `eval` takes no
lock: evaluating a checkpoint while the run goes on is fine.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from rl_core.config import ConfigError

logger = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"


@contextlib.contextmanager
def hold_run_dir(log_dir: Path) -> Iterator[None]:
    """Hold the run directory's lock; ConfigError naming the holder when another run holds it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise ConfigError(f"logger.log_dir={log_dir} is in use by another run ({holder}): two runs there would "
                              "write the same metrics and checkpoints; wait for it to end, or set another "
                              "logger.log_dir") from None
        except OSError as exc:  # a filesystem without locks (some network filesystems): run unguarded
            logger.warning("could not lock %s (%s): nothing stops a second run in this directory", log_dir, exc)
            locked = False
        if locked:
            lock.seek(0)
            lock.truncate()
            lock.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                       f"{datetime.datetime.now().isoformat(timespec='seconds')}\n")
            lock.flush()
        yield
