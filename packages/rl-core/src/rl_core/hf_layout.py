"""Hugging Face checkpoint names -> transformers' in-memory parameters.

transformers >= 5 converts some weights at load time: MoE experts stored one tensor per expert on disk
(`mlp.experts.0.gate_proj.weight`, ...) become one fused (E, ...) parameter in memory, and some modules
are renamed (Mixtral's `block_sparse_moe` is `mlp`). Checkpoints, `export_hf_weights()` and vLLM use the
on-disk names; a model's `named_parameters()` has the in-memory ones. `CheckpointLayout` places on-disk
tensors into in-memory parameters, assembling a fused one from its pieces (which may arrive in any order,
from several files). It inverts `transformers.core_model_loading.revert_weight_conversion`, the conversion
`save_pretrained` applies. Needs transformers only where it converts anything; imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn


class CheckpointLayout:
    """Which on-disk tensors make each converted parameter of `model`, and the pieces received so far.

    `targets` maps in-memory names to the tensors to fill (parameters, persistent buffers). A name that is
    a target itself needs no conversion; `owner(key)` names the target an on-disk `key` is part of.
    """

    def __init__(self, model: nn.Module, targets: Mapping[str, Tensor]) -> None:
        self.model, self.targets = model, targets
        self._target_of: dict[str, str] = {}  # on-disk name -> converted parameter name
        self._pending: dict[str, tuple[Tensor, dict[str, Tensor]]] = {}  # name -> (full, unread pieces' indices)
        try:  # transformers >= 5: the inverse of the load-time conversion, the one save_pretrained applies
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:
            return
        self._revert = revert_weight_conversion
        for name, target in targets.items():
            pieces = self._revert(model, {name: torch.empty(target.shape, device="meta")})
            if set(pieces) != {name}:
                self._target_of.update(dict.fromkeys(pieces, name))

    def owner(self, key: str) -> str | None:
        """The in-memory parameter that on-disk tensor `key` is (part of), if it is a converted one."""
        return self._target_of.get(key)

    def add(self, key: str, piece: Tensor) -> tuple[str, Tensor] | None:
        """Place on-disk tensor `key`; (parameter name, full tensor) once all its pieces are in, else None."""
        name = self._target_of[key]
        if name not in self._pending:
            target = self.targets[name]
            # where each piece's elements go: the reverse conversion applied to the flat positions
            positions = torch.arange(target.numel()).view(target.shape)
            index = self._revert(self.model, {name: positions})
            self._pending[name] = (torch.empty(target.shape, dtype=target.dtype), index)
        full, index = self._pending[name]
        expected = index[key]
        if piece.numel() != expected.numel():
            raise ValueError(f"{key!r} has shape {tuple(piece.shape)}; {name!r} expects {tuple(expected.shape)} "
                             "for this piece")
        full.view(-1)[index.pop(key).reshape(-1)] = piece.reshape(-1).to(device=full.device, dtype=full.dtype)
        if index:
            return None
        del self._pending[name]
        return name, full

    def incomplete(self) -> dict[str, list[str]]:
        """Converted parameters some but not all of whose pieces were added: {name: missing on-disk names}."""
        return {name: sorted(index) for name, (_, index) in self._pending.items()}
