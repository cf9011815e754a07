"""`HostReads`: the reads of tensor values by Python code inside a model's forward and backward, on any device.

On CUDA, `.item()`, `.tolist()`, `int(t)`, `bool(t)`, `torch.nonzero`, boolean-mask indexing and friends make
the host wait until the GPU has drained its queue; inside a layer that is once per layer and micro-batch,
and the GPU idles while the host launches what follows. `rl_core.testing.cuda_syncs` counts them on a GPU;
this counts the same calls on the CPU, so CI catches them too.

Counted only while one of `modules` runs its forward (forward hooks: a `TorchFunctionMode` sees the
Python-level calls, `.tolist()` included) or autograd runs a backward (hooks and custom Functions' backward:
function modes are off there, so a `TorchDispatchMode` sees the aten ops the reads become; a CPU tensor's
`.tolist()` becomes none and is not seen). The engine's own bookkeeping before and after the passes does
not count. `ignore`: (path suffix, function name) of callers whose reads are CPU-only by design.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
          torch.Tensor.masked_select, torch.masked_select, torch.Tensor.unique, torch.unique, torch.equal,
          torch.Tensor.any, torch.Tensor.all}
_ATEN_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default}


def _is_read(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in (torch.Tensor.any, torch.Tensor.all):
        return False  # a device tensor out; reading it is the __bool__ that follows
    if func in _READS:
        return True
    if func is torch.Tensor.__getitem__ and len(args) > 1:  # t[mask]: the result's shape needs the mask's count
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # output size from the repeats' values
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
            and kwargs.get("output_size") is None
    return False


class HostReads(TorchFunctionMode):
    """`with HostReads(modules, ignore=...) as reads:` ... `reads.count`, `reads.where` (caller -> count)."""

    def __init__(self, modules: Iterable[nn.Module], ignore: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__()
        self.ignore = tuple(ignore)
        self.where: Counter[str] = Counter()
        self._depth = 0
        self._backward = _BackwardReads(self)
        self._hooks = []
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(self._enter))
            self._hooks.append(module.register_forward_hook(self._leave, always_call=True))

    @property
    def count(self) -> int:
        return sum(self.where.values())

    def _enter(self, *_: Any) -> None:
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth -= 1

    def __enter__(self) -> HostReads:
        self._backward.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        super().__exit__(*exc)
        self._backward.__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._depth > 0 and torch._C._current_graph_task_id() == -1 and _is_read(func, args, kwargs):
            self._record()
        return func(*args, **kwargs)

    def _record(self) -> None:
        caller = self._caller()
        if caller is not None:
            self.where[caller] += 1

    def _caller(self) -> str | None:
        """`path:line (function)` of the first frame outside torch and other torch-function handlers; None
        when it is an ignored one."""
        frame = sys._getframe(3)
        while frame is not None and ("/torch/" in frame.f_code.co_filename
                                     or frame.f_code.co_name in ("__torch_function__", "__torch_dispatch__")):
            frame = frame.f_back
        if frame is None:
            return "?"
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if any(path.endswith(suffix) and name == function for suffix, function in self.ignore):
            return None
        return f"{path}:{frame.f_lineno} ({name})"


class _BackwardReads(TorchDispatchMode):
    """The aten ops of reads made while autograd runs a backward (where function modes are off)."""

    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _ATEN_READS and torch._C._current_graph_task_id() != -1:
            self.owner._record()
        return func(*args, **(kwargs or {}))
