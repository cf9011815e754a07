"""A KV cache whose per-layer buffers are allocated once per generate call and written in place.

transformers' DynamicCache grows by `torch.cat` every decode step, copying the whole cache each time
(quadratic in the length; a fifth of the decode time of a tiny model on CPU). `PreallocatedLayer`
reserves prompt + max_new_tokens positions up front; `keys` / `values` are views of the filled part.
Batch compaction (`batch_select_indices`) and sample expansion (`batch_repeat_interleave`) index the
buffers. Only full-attention layers are replaced; sliding-window and other layer kinds keep
transformers' own implementation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _dynamic_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def make_cache(config: Any, capacity: int) -> Any:
    """A DynamicCache for `config` whose full-attention layers hold `capacity` positions in place."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    layer_cls = _dynamic_layer_class()
    layer_type = preallocated_layer_type()
    cache.layers = [layer_type(capacity) if type(layer) is layer_cls else layer for layer in cache.layers]
    return cache


_LAYER_TYPE: type | None = None


def preallocated_layer_type() -> type:
    """The PreallocatedLayer class (built lazily: transformers is imported only when a cache is made)."""
    global _LAYER_TYPE
    if _LAYER_TYPE is None:
        _LAYER_TYPE = _build_layer_type(_dynamic_layer_class())
    return _LAYER_TYPE


def _build_layer_type(base: type) -> type:
    class PreallocatedLayer(base):
        """DynamicLayer with buffers (B, H, capacity, D) filled in place; grows by doubling if needed."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity, self.length = int(capacity), 0

        def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            b, h, _, d = key_states.shape
            self._k = key_states.new_empty(b, h, self.capacity, d)
            self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
            self.length = 0
            self._refresh()
            self.is_initialized = True

        def _refresh(self) -> None:
            self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if end > self._k.shape[2]:  # more tokens than reserved: grow (rare; callers reserve enough)
                extra = max(end, 2 * self._k.shape[2]) - self._k.shape[2]
                self._k = torch.cat([self._k, self._k.new_empty(*self._k.shape[:2], extra, self._k.shape[3])], 2)
                self._v = torch.cat([self._v, self._v.new_empty(*self._v.shape[:2], extra, self._v.shape[3])], 2)
            self._k[:, :, self.length: end] = key_states
            self._v[:, :, self.length: end] = value_states
            self.length = end
            self._refresh()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_select_indices(self, indices: Tensor) -> None:
            if self.is_initialized:
                self._k, self._v = self._k[indices], self._v[indices]
                self._refresh()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self._k = self._k.repeat_interleave(repeats, dim=0)
                self._v = self._v.repeat_interleave(repeats, dim=0)
                self._refresh()

        def reset(self) -> None:
            self.length = 0
            if self.is_initialized:
                self._refresh()

        def crop(self, tokens_to_remove: int) -> None:
            raise ValueError("PreallocatedLayer does not support crop (not used by rollout's decode loop)")

    return PreallocatedLayer
