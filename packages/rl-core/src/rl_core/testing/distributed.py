"""Run a function on N ranks by forking (CPU) or spawning (CUDA) the test process.

torchrun costs ~9 s per launch; forking a process that has already imported torch (and megatron)
costs ~0.3 s (shared/notes/megatron-cpu-probe/part2). Every package's multi-rank tests use this:

    results = run_distributed(my_check, world_size=2, args=(...))   # one return value per rank

The function runs as `fn(rank, world_size, *args)` inside an initialised process group (gloo unless
`backend` says otherwise) with one OpenMP thread; exceptions on any rank are re-raised in the parent
with the rank's traceback. A forked child cannot use CUDA once the parent touched it ("Cannot
re-initialize CUDA in forked subprocess"), so ranks are spawned whenever CUDA is involved (an NCCL
backend such as `CUDA_BACKEND`, or CUDA already initialised in this process): `fn` and `args` must then
be picklable and each rank pays the imports again (seconds).
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CUDA_BACKEND = "cpu:gloo,cuda:nccl"  # the engines' own choice with CUDA: NCCL for GPU tensors, gloo for CPU ones


def _rendezvous_store(rank: int, world_size: int, port: Any, port_ready: Any, timeout: float) -> Any:
    """The group's TCPStore, race-free: rank 0 listens on a port the OS gives it (port 0) and publishes it.

    A port picked free in the parent and bound later by rank 0 can be taken in between (by another test's
    rendezvous or a client socket's ephemeral port): CI saw "EADDRINUSE ... port: 35259" that way.
    """
    from datetime import timedelta

    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        port.value = store.port
        port_ready.set()
        return store
    if not port_ready.wait(timeout):
        raise TimeoutError(f"rank 0 did not open its rendezvous store within {timeout:.0f} s")
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timedelta(seconds=timeout))


def _worker(fn: Callable, rank: int, world_size: int, port: Any, port_ready: Any, args: tuple, queue: Any,
            backend: str, timeout: float) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # a rank that hangs prints where, just before the parent gives up on it (the test's captured stderr)
    faulthandler.dump_traceback_later(max(timeout - 5.0, 1.0), exit=False)
    torch.set_num_threads(1)
    try:
        store = _rendezvous_store(rank, world_size, port, port_ready, timeout)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
        if isinstance(fn, _FunctionByFile):
            fn = fn.load()
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle: torch's ForkingPickler would pass tensors as shared-memory handles that die
        # with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class _FunctionByFile:
    """A function a spawned rank loads from its source file: pytest's importlib mode gives test modules
    names that a fresh interpreter cannot import, so pickling the function by module name would fail."""

    path: str
    module: str
    qualname: str

    def load(self) -> Callable:
        module = sys.modules.get(self.module)
        if module is None:
            spec = importlib.util.spec_from_file_location(self.module, self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[self.module] = module
            spec.loader.exec_module(module)
        target: Any = module
        for part in self.qualname.split("."):
            target = getattr(target, part)
        return target


def start_method_for(backend: str) -> str:
    """'spawn' whenever CUDA is involved (an NCCL group, or CUDA initialised in this process), else 'fork'."""
    import torch

    return "spawn" if "nccl" in backend or torch.cuda.is_initialized() else "fork"


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: tuple = (), timeout: float = 300.0,
                    backend: str = "gloo", start_method: str | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return results by rank.

    `start_method` None picks `start_method_for(backend)`; "spawn" may be forced (tests of the spawn path).
    """
    method = start_method or start_method_for(backend)
    if method == "fork" and start_method_for(backend) == "spawn":
        raise ValueError("run_distributed(start_method='fork') after CUDA was initialised (or with an NCCL backend): "
                         "forked ranks cannot use CUDA; leave start_method=None to spawn them")
    ctx = mp.get_context(method)
    if method == "spawn":
        fn = _FunctionByFile(inspect.getfile(fn), fn.__module__, fn.__qualname__)
    else:
        # Garbage of this process is freed here, not in a forked rank: a rank that collects it runs destructors
        # that join threads which fork did not copy (a Ray GcsClient left by a test that ran Ray in this process:
        # the rank hung in ~ClientCallManager's std::thread::join).
        gc.collect()
    queue = ctx.Queue()
    port, port_ready = ctx.Value("i", 0), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, port_ready, args, queue, backend, timeout))
             for r in range(world_size)]
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
        silent = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results]
        errors.append(f"no result from every rank within {timeout:.0f} s ({type(exc).__name__}): " + "; ".join(
            f"rank {r} still running (its stack is in the test's stderr)" if code is None
            else f"rank {r} exited with code {code} without reporting" for r, code in silent))
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
