"""The Megatron engine's LoRA layers: megatron's column- and row-parallel linears plus one adapter per HF module.

`LoRAColumnParallelLinear` / `LoRARowParallelLinear` replace megatron's linears in the local layer spec of a LoRA
run (model.layer_spec) and add `scaling * B A x` to the base output (the (output, bias) contract kept; with
skip_bias_add the caller adds the bias later, which commutes with the sum). `apply_lora` puts `LoRAAdapters` on
the linears whose HF modules are targets, draws their initial A and freezes every base parameter (before the DDP
wrap: megatron's DDP and distributed optimizer then hold the adapters only).

Tensor parallelism with megatron's own autograd mappings (x is this rank's input of the base linear):
- column base (linear_qkv: q, k, v; linear_fc1: gate, up): A replicated, B sharded on its output rows as the base
  (q/k/v by query groups, gate/up by halves). u = A x; without SP `copy_to_tensor_model_parallel_region(u)` (dL/du
  is a sum over the ranks' B shards: all-reduced in backward), with SP (x: the local sequence chunk)
  `gather_from_sequence_parallel_region(u)`. The pieces' outputs B_i u are interleaved into the base's local
  layout (per local query group: its q heads, k, v; for fc1: the local gate shard, then the local up shard).
- row base (linear_proj: o; linear_fc2: down): A sharded on its input columns as the base, B replicated.
  u = `reduce_from_tensor_model_parallel_region(A x)`, with SP `reduce_scatter_to_sequence_parallel_region`.
Under SP the replicated factor (column: A, row: B) sees this rank's sequence chunk only, so its gradient is a
partial sum: it carries `sequence_parallel = True`, and megatron's finalize_model_grads all-reduces it over TP (the
norm weights' treatment; DDP's scaling is over DP only). TP attributes (`set_tensor_model_parallel_attributes`)
make the grad norm count a replicated factor once and checkpoints shard the other one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, mappings
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor, nn
from torch.nn import functional as F

from engine_megatron.lora import LINEARS, hf_modules, leaf, select_targets
from rl_core import lora as shared

logger = logging.getLogger(__name__)


class LoRAAdapter(nn.Module):
    """A (dim, in) and B (out, dim) of one HF module: this rank's shards of them."""

    def __init__(self, a_shape: tuple[int, int], b_shape: tuple[int, int], parallel: str, sequence_parallel: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(a_shape, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, dtype=dtype))
        sharded, replicated, dim = (self.lora_B, self.lora_A, 0) if parallel == "column" else (self.lora_A, self.lora_B, 1)
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        replicated.sequence_parallel = sequence_parallel  # its grad is per sequence chunk: summed over TP


def _to_output_region(u: Tensor, parallel: str, sequence_parallel: bool) -> Tensor:
    """A x (per rank) -> the u that B multiplies, with the backward each needs (module docstring)."""
    if parallel == "column":
        return (mappings.gather_from_sequence_parallel_region(u) if sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region(u))
    return (mappings.reduce_scatter_to_sequence_parallel_region(u) if sequence_parallel
            else mappings.reduce_from_tensor_model_parallel_region(u))


class LoRAAdapters(nn.Module):
    """The adapters of one megatron linear: children named by HF leaf (`q_proj`), for the fused modules that are
    targets; `pieces` lists every fused module (leaf, local output rows) in the base's order, `blocks` how many
    times they interleave in the local output (linear_qkv: the local query groups; else 1)."""

    def __init__(self, adapters: dict[str, LoRAAdapter], pieces: list[tuple[str, int]], blocks: int, parallel: str,
                 cfg: shared.LoRAConfig, sequence_parallel: bool) -> None:
        super().__init__()
        for name, adapter in adapters.items():
            self.add_module(name, adapter)
        self.pieces, self.blocks, self.parallel = pieces, blocks, parallel
        self.sequence_parallel = sequence_parallel
        self.scaling = cfg.scaling
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """scaling * [B_i A_i x]_i, interleaved into the base's local output layout (s, b, out_local)."""
        outputs: list[Tensor | None] = []
        for name, _ in self.pieces:
            adapter = self._modules.get(name)
            if adapter is None:
                outputs.append(None)
                continue
            u = _to_output_region(F.linear(self.dropout(x), adapter.lora_A), self.parallel, self.sequence_parallel)
            outputs.append(F.linear(u, adapter.lora_B))
        lead = next(y for y in outputs if y is not None).shape[:-1]
        full = [y if y is not None else x.new_zeros(*lead, rows) for y, (_, rows) in zip(outputs, self.pieces)]
        return torch.cat([y.unflatten(-1, (self.blocks, -1)) for y in full], dim=-1).flatten(-2) * self.scaling

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """The sharded factor along its TP axis (column: B on 0, row: A on 1), the other one replicated."""
        axes = {name: param.partition_dim for name, param in self.named_parameters() if param.tensor_model_parallel}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=ps.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


class _WithAdapters:
    """A megatron linear plus the output of its `lora` child (`LoRAAdapters`, present when one of its HF modules is
    a target); `adapter_enabled = False` makes it the base linear (the KL reference)."""

    adapter_enabled = True

    def forward(self, input_: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(input_, *args, **kwargs)
        adapters = self._modules.get("lora")
        if adapters is not None and self.adapter_enabled:
            output = output + adapters(input_)
        return output, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        # megatron's linear maps every state-dict entry, the adapters' as replicated: theirs replace them
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapters = self._modules.get("lora")
        if adapters is not None:
            sharded.update(adapters.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return sharded


class LoRAColumnParallelLinear(_WithAdapters, ColumnParallelLinear):
    """megatron's ColumnParallelLinear (linear_qkv, linear_fc1) with adapters on its fused HF modules."""


class LoRARowParallelLinear(_WithAdapters, RowParallelLinear):
    """megatron's RowParallelLinear (linear_proj, linear_fc2) with an adapter on its HF module."""


def lora_layers(module: nn.Module) -> list[_WithAdapters]:
    """Every linear of the model that carries adapters."""
    return [m for m in module.modules() if isinstance(m, _WithAdapters) and m._modules.get("lora") is not None]


def _full_shapes(tc: Any, linear: str) -> tuple[int, list[int]]:
    """(input features, output rows of each fused HF module) of a megatron linear, unsharded."""
    q, kv = tc.num_attention_heads * tc.kv_channels, tc.num_query_groups * tc.kv_channels
    return {"self_attention.linear_qkv": (tc.hidden_size, [q, kv, kv]),
            "self_attention.linear_proj": (q, [tc.hidden_size]),
            "mlp.linear_fc1": (tc.hidden_size, [tc.ffn_hidden_size] * 2),
            "mlp.linear_fc2": (tc.ffn_hidden_size, [tc.hidden_size])}[linear]


def _build_adapters(base: nn.Module, linear: str, leaves: list[str], full_a: dict[str, Tensor], tc: Any,
                    cfg: shared.LoRAConfig) -> LoRAAdapters:
    """This rank's adapters of megatron linear `base` (fusing HF modules `leaves`) from the full initial A of each
    target (leaf -> A): the rank's shard of A (row) or all of it (column), B zero."""
    parallel = LINEARS[linear]
    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    in_features, rows = _full_shapes(tc, linear)
    local_rows = [r // tp for r in rows] if parallel == "column" else rows
    local_shape = (sum(local_rows), in_features if parallel == "column" else in_features // tp)
    if not isinstance(base, _WithAdapters) or tuple(base.weight.shape) != local_shape:
        raise RuntimeError(f"{linear} ({type(base).__name__}, local shape {tuple(base.weight.shape)}) is not a LoRA "
                           f"linear of shape {local_shape}: the layer spec or layout is not the one LoRA expects")
    sp = bool(tc.sequence_parallel) and tp > 1
    adapters = {}
    for name, out in zip(leaves, local_rows):
        if name in full_a:
            a = full_a[name] if parallel == "column" else full_a[name].chunk(tp, dim=1)[rank]
            adapters[name] = LoRAAdapter(tuple(a.shape), (out, cfg.dim), parallel, sp, tc.params_dtype)
            with torch.no_grad():
                adapters[name].lora_A.copy_(a)
    blocks = tc.num_query_groups // tp if linear == "self_attention.linear_qkv" else 1
    return LoRAAdapters(adapters, list(zip(leaves, local_rows)), blocks, parallel, cfg, sp)


def apply_lora(module: nn.Module, model_cfg: Any, cfg: shared.LoRAConfig) -> None:
    """Adapters on this rank's target modules (`select_targets`) and every base parameter frozen; before the DDP
    wrap. A is drawn full-size from one generator seeded `INIT_SEED`, in HF module order over all layers on every
    rank (pipeline stages too), then cut into this rank's shard: the DTensor engine's initial values, any layout."""
    targets = set(select_targets(model_cfg, cfg))
    module.requires_grad_(False)
    tc = model_cfg.transformer_config
    layers = {layer.layer_number - 1: layer for layer in module.decoder.layers}  # global index -> this stage's layer
    generator = torch.Generator().manual_seed(shared.INIT_SEED)
    for index in range(tc.num_layers):
        for linear in LINEARS:
            modules = hf_modules(model_cfg, index, linear)
            in_features = _full_shapes(tc, linear)[0]
            full_a = {leaf(m): shared.init_lora_a((cfg.dim, in_features), generator) for m in modules if m in targets}
            if full_a and index in layers:
                base = layers[index].get_submodule(linear)
                base.lora = _build_adapters(base, linear, [leaf(m) for m in modules], full_a, tc, cfg)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    logger.info("LoRA: %d target modules (dim %d, alpha %g); trainable parameters on this rank %d of %d (%.3f%%)",
                len(targets), cfg.dim, cfg.alpha, trainable, total, 100 * trainable / max(total, 1))
