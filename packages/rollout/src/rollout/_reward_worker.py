"""The loop a reward worker subprocess runs (rollout.environments.pool starts it).

Kept free of torch and rl_core imports: a worker imports only this module and the user's reward function
(plus, as any `spawn`ed process, the caller's `__main__` module). Results travel back as plain tuples.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import traceback
from typing import Any

# RewardRequest fields a reward function gets only where its signature names them as parameters: a function written
# as fn(prompt, completion, metadata) keeps working, and a **kwargs catch-all does not count (it may pass them on).
# finish_reason: "stop" (the completion ended with a stop token) or "length" (cut at max_new_tokens); decoding drops
# special tokens, so the text alone cannot tell a completion that stopped from one padded out with <pad> or <s>.
OPTIONAL_FIELDS = ("finish_reason",)


def resolve_function(path: str) -> Any:
    """Import `pkg.module:function`; ValueError naming the path and the problem otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {path!r} is not an import path of the form 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, and what the module's own code raises: SyntaxError, NameError, ...
        name = "" if isinstance(exc, ImportError) else f"{type(exc).__name__}: "
        raise ValueError(f"reward function {path!r}: module {module_name!r} does not import: {name}{exc}") from exc
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
        if "reward" not in value:  # else "returned None", about a function that returned a dict
            raise TypeError(f"reward function returned a dict without 'reward' (keys: {sorted(map(str, value))}); "
                            "expected a finite float (or bool, or a dict/RewardResult with a finite 'reward')")
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


def optional_fields_of(fn: Any) -> frozenset[str]:
    """The OPTIONAL_FIELDS that `fn`'s signature names as keyword-passable parameters."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (some builtins): the required fields only
        return frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(name for name in OPTIONAL_FIELDS if name in params and params[name].kind in keyword)


def call_reward(fn: Any, kwargs: dict[str, Any], prompt: str, completion: str, metadata: dict[str, Any],
                optional: dict[str, Any] | None = None) -> tuple:
    """('ok', reward, correct) or ('error', message): never raises. `optional`: the OPTIONAL_FIELDS values `fn`
    takes (`optional_fields_of`)."""
    try:
        value = fn(prompt=prompt, completion=completion, metadata=metadata, **(optional or {}), **kwargs)
    except (Exception, SystemExit) as exc:  # a user function's bug scores 0; it must not stop the run (nor
        return ("error", describe_exception(exc))  # sys.exit() kill the worker: respawned on every call)
    try:
        reward, correct = normalize_result(value)
    except TypeError as exc:  # the message says what came back; a traceback here would show only this module
        return ("error", f"TypeError: {exc}")
    return ("ok", reward, correct)


def describe_exception(exc: BaseException) -> str:
    """`Type: message (at file:line in function)` of the reward function's own frame (and of the innermost one
    where it raised, when that is another), then the traceback from the reward function down. The first line is
    what the logs keep (they cut a message at a few hundred characters), so it must name the user's line, not
    this module's."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is call_reward's own `fn(...)` line
    where = [f"{f.filename}:{f.lineno} in {f.name}" for f in (frames[:1] + frames[-1:] if len(frames) > 1 else frames)]
    head = f"{type(exc).__name__}: {exc}" + (f" (at {' -> '.join(where)})" if where else "")
    if not frames:  # raised by the call itself (e.g. a signature that does not take the keyword arguments)
        return head
    return head + "\nTraceback (most recent call last):\n" + "".join(traceback.format_list(frames)).rstrip()


def worker_main(conn: Any, fn_path: str, kwargs: dict[str, Any], scratch: str, memory_limit_mb: int | None,
                launch_dir: str) -> None:
    """Confine this process (rollout._sandbox), import the function, report readiness and the sandbox
    layers that hold, then answer (task_id, prompt, completion, metadata, optional fields) forever.

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
        takes = optional_fields_of(fn)
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
        task_id, prompt, completion, metadata, optional = message
        conn.send((task_id, call_reward(fn, kwargs, prompt, completion, metadata,
                                        {k: v for k, v in optional.items() if k in takes})))
