"""The loop a reward worker subprocess runs (rollout.environments.pool starts it).

Kept free of torch and rl_core imports: a worker imports only this module and the user's reward function
(plus, as any `spawn`ed process, the caller's `__main__` module). Results travel back as plain tuples.
"""

from __future__ import annotations

import importlib
import math
import numbers
import traceback
from typing import Any


def resolve_function(path: str) -> Any:
    """Import `pkg.module:function`; ValueError naming the path and the problem otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} is not an import path of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function {path!r}: module {module_name!r} does not import: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward function {path!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward function {path!r} is a {type(target).__name__}, not a callable")
    return target


def normalize_result(value: Any) -> tuple[float, bool | None]:
    """A reward function's return (real number, bool, dict or object with .reward) -> (reward, correct).

    Any `numbers.Real` counts, so NumPy scalars (np.float32, np.int64) do, and np.bool_ as a bool; strings do not."""
    correct = None
    if isinstance(value, dict):
        correct = value.get("correct")
        value = value.get("reward")
    elif hasattr(value, "reward"):
        correct = getattr(value, "correct", None)
        value = value.reward
    if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", None) == "b":  # bool, np.bool_
        correct = bool(value) if correct is None else correct
        value = float(value)
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise TypeError(f"reward function returned {value!r}; expected a finite float (or bool, or "
                        f"a dict/RewardResult with a finite 'reward')")
    return float(value), (None if correct is None else bool(correct))


def call_reward(fn: Any, kwargs: dict[str, Any], prompt: str, completion: str, metadata: dict[str, Any]) -> tuple:
    """('ok', reward, correct) or ('error', message): never raises."""
    try:
        value = fn(prompt=prompt, completion=completion, metadata=metadata, **kwargs)
        reward, correct = normalize_result(value)
        return ("ok", reward, correct)
    except Exception as exc:  # a user function's bug scores 0; it must not stop the run
        return ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


def worker_main(conn: Any, fn_path: str, kwargs: dict[str, Any], scratch: str, memory_limit_mb: int | None,
                launch_dir: str) -> None:
    """Confine this process (rollout._sandbox), import the function, report readiness and the sandbox
    layers that hold, then answer (task_id, prompt, completion, metadata) forever.

    `launch_dir` (the pool creator's working directory) is on the import path, so `my_reward:score` next to
    where the run was started imports whether the caller is a script (whose sys.path lacks it), an
    interpreter or a Ray actor (whose sys.path has it)."""
    import os
    import sys

    from rollout._sandbox import confine

    # A session (process group) of its own: the pool kills the whole group, so processes the reward
    # function starts die with the worker instead of outliving it as orphans.
    os.setsid()
    # absolute before the chdir into the scratch directory ('' would then name the scratch directory)
    sys.path[:] = [os.path.abspath(p) for p in sys.path]
    if launch_dir not in sys.path:
        sys.path.append(launch_dir)  # last: the launch directory's files never shadow installed modules
    try:
        held = confine(scratch, memory_limit_mb)
        fn = resolve_function(fn_path)
    except Exception as exc:
        conn.send(("init_error", str(exc)))
        return
    conn.send(("ready", held))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        task_id, prompt, completion, metadata = message
        conn.send((task_id, call_reward(fn, kwargs, prompt, completion, metadata)))
