"""`LargestTensors`: a TorchDispatchMode that records the largest tensor each op creates, by dtype;
`PeakLiveTensors`: the most bytes such tensors hold at once.

Used to check memory bounds on CPU (e.g. no float32 tokens x vocab intermediate beyond the logprob
chunk): every op's outputs pass through `__torch_dispatch__`, forward and backward alike (autograd
runs the backward ops under the same mode when `.backward()` is called inside it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LargestTensors(TorchDispatchMode):
    """Inside `with LargestTensors() as seen:`, `seen.largest[dtype]` is (numel, shape, op) of the biggest
    tensor an op returned; with `last_dim=V` only tensors shaped (..., V) count (tokens x vocab, not the
    (vocab, hidden) weights or FSDP's flat gradient buffers)."""

    def __init__(self, last_dim: int | None = None) -> None:
        super().__init__()
        self.last_dim = last_dim
        self.largest: dict[torch.dtype, tuple[int, tuple[int, ...], str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if (isinstance(tensor, torch.Tensor) and not _is_view(func)
                    and (self.last_dim is None or (tensor.dim() > 0 and tensor.shape[-1] == self.last_dim))):
                best = self.largest.get(tensor.dtype, (0, (), ""))
                if tensor.numel() > best[0]:
                    self.largest[tensor.dtype] = (tensor.numel(), tuple(tensor.shape), str(func))
        return out

    def numel(self, dtype: torch.dtype) -> int:
        return self.largest.get(dtype, (0,))[0]


def _is_view(func: Any) -> bool:
    """Views allocate nothing (a slice of the logits is not a new tokens x vocab tensor)."""
    schema = getattr(func, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None
                and not schema.returns[0].alias_info.is_write)


class PeakLiveTensors(TorchDispatchMode):
    """Inside `with PeakLiveTensors(last_dim=V) as live:`, `live.peak_bytes` is the most bytes that tensors
    shaped (..., V) created by ops inside the block held at once (freed ones leave the count when Python
    drops them). Tensors from outside the block (e.g. the logits themselves) are not counted; views and
    in-place results allocate nothing."""

    def __init__(self, last_dim: int) -> None:
        super().__init__()
        self.last_dim = last_dim
        self.live_bytes = self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        schema = getattr(func, "_schema", None)
        if schema and schema.returns and schema.returns[0].alias_info is not None:
            return out  # a view or the input written in place
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0 and tensor.shape[-1] == self.last_dim:
                size = tensor.untyped_storage().nbytes()
                self.live_bytes += size
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(tensor, self._free, size)
        return out

    def _free(self, size: int) -> None:
        self.live_bytes -= size
