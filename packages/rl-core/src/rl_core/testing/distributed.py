"""Run a function on N gloo ranks by forking the test process.

torchrun costs ~9 s per launch; forking a process that has already imported torch (and megatron)
costs ~0.3 s (shared/notes/megatron-cpu-probe/part2). Every package's multi-rank tests use this:

    results = run_distributed(my_check, world_size=2, args=(...))   # one return value per rank

The function runs as `fn(rank, world_size, *args)` inside an initialised gloo process group with one
OpenMP thread; exceptions on any rank are re-raised in the parent with the rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from typing import Any

from rl_core.distributed import free_port


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle: torch's ForkingPickler would pass tensors as shared-memory handles that die
        # with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 300.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; return results by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in procs:
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks may now hang in a collective: stop them below
    except Exception as exc:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"no result from every rank within {timeout:.0f} s ({type(exc).__name__})")
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
