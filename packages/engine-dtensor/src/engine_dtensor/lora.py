"""LoRA: low-rank adapters on a Hugging Face model's linear layers, the base weights frozen.

Owns `LoRALinear` (y = base(x) + alpha/dim * B(A(dropout(x))), A kaiming-uniform, B zero: at initialisation the
model is the base model exactly), `apply_lora` (injection into the decoder layers on the meta device, before
parallelize.py wraps anything, and freezing of every base parameter), the adapters' own initialisation after the
base weights are loaded, switching the adapters off (the KL reference is the base model) and the merged weight
W + alpha/dim * B @ A that export sends under the base weight's HF name, and the adapters alone with peft's
adapter_config.json (the PEFT format: peft and vLLM load it on the base model). The base weight keeps its name under
`<module>.base_layer.` (peft's spelling), which `parallelize.hf_name` drops. Does not own sharding (FSDP2 shards
adapters and frozen weights in the same per-layer unit; TP shards them with their base layer:
`parallelize.LoRAParallel`) nor checkpoint files (checkpoint.py), nor what the Megatron engine shares (the config
schema, the initial values, the merge, target selection and the PEFT format: rl_core.lora).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from engine_dtensor.config import LoRAConfig
from engine_dtensor.loading import copy_into_shard, to_empty_keeping_ties
from engine_dtensor.parallelize import decoder_layers, hf_name
from rl_core import lora as shared

logger = logging.getLogger(__name__)

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: base(x) + scaling * lora_B(lora_A(dropout(x)))."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig) -> None:
        super().__init__()
        self.base_layer = base  # the name parallelize.hf_name drops: the weight keeps its HF name
        # trainable: float32 master weights whatever the base's dtype (FSDP casts them for compute)
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, cfg.dim, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(cfg.dim, base.out_features, bias=False, device=device, dtype=torch.float32)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.scaling = cfg.scaling
        self.adapter_enabled = True

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_layer(x)
        if not self.adapter_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    @torch.no_grad()
    def init_adapter(self, generator: torch.Generator) -> None:
        """A as nn.Linear's default (rl_core.lora.init_lora_a), B zero; drawn as full tensors and cut into this
        rank's shards, so that the values do not depend on the layout."""
        full_a = shared.init_lora_a(tuple(self.lora_A.weight.shape), generator).to(self.lora_A.weight.dtype)
        copy_into_shard(self.lora_A.weight, full_a)
        copy_into_shard(self.lora_B.weight, torch.zeros(tuple(self.lora_B.weight.shape), dtype=full_a.dtype))

    def merged_weight(self, weight: Tensor) -> Tensor:
        """`merge` of the base weight `weight` (full) with this module's adapter; gathers A and B (a collective
        under FSDP)."""
        return shared.merge(weight, full_tensor(self.lora_A.weight), full_tensor(self.lora_B.weight), self.scaling)


def full_tensor(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (all-gather), a plain tensor as it is."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def select_targets(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Full names of the decoder layers' nn.Linear modules that get an adapter (rl_core.lora.select_modules)."""
    layers = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    linears = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.startswith(prefix + ".")]
    return shared.select_modules(linears, cfg, type(model).__name__)


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, frozen_dtype: torch.dtype) -> None:
    """Wrap the selected linear layers in LoRALinear and freeze every base parameter (embeddings, norms and
    lm_head included). Runs before parallelize(): FSDP2 takes requires_grad from the parameters it shards.

    Frozen parameters are stored in `frozen_dtype`, the compute dtype: they need no float32 master copy, and FSDP
    would cast them to it for every forward anyway, so bf16 storage halves their memory and changes no result."""
    targets = select_targets(model, cfg)
    model.requires_grad_(False)
    for param in model.parameters():  # in place: a tied weight stays one parameter
        param.data = param.data.to(frozen_dtype)
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), cfg))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA: %d adapters (dim %d, alpha %g); trainable parameters %d of %d (%.3f%%)",
                len(targets), cfg.dim, cfg.alpha, trainable, total, 100 * trainable / total)


def lora_modules(model: nn.Module) -> list[LoRALinear]:
    """Every LoRALinear of the model (none without LoRA: the helpers below are then no-ops)."""
    return [module for module in model.modules() if isinstance(module, LoRALinear)]


@contextlib.contextmanager
def adapters_detached(model: nn.Module) -> Iterator[None]:
    """The adapter modules out of the module tree for the block: the checkpoint loader then sees the base model's
    parameters only (the HF checkpoint has no adapters); `materialize_adapters` gives them storage after."""
    modules = lora_modules(model)
    detached = [{name: module._modules.pop(name) for name in ADAPTER_NAMES} for module in modules]
    try:
        yield
    finally:
        for module, adapters in zip(modules, detached):
            module._modules.update(adapters)


def materialize_adapters(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for the adapters of a parallelised meta model, then their initial values."""
    generator = torch.Generator().manual_seed(shared.INIT_SEED)
    for module in lora_modules(model):
        for name in ADAPTER_NAMES:
            to_empty_keeping_ties(getattr(module, name), device)  # swapped in place: FSDP2 keeps its references
        module.init_adapter(generator)


def is_adapter_param(name: str) -> bool:
    """Whether parameter `name` belongs to an adapter (not part of the HF model)."""
    return any(f"{adapter}." in name for adapter in ADAPTER_NAMES)


def adapters_by_module(model: nn.Module) -> dict[str, LoRALinear]:
    """HF name of each adapted module (`model.layers.0.self_attn.q_proj`: the name peft and vLLM give it) -> its
    LoRALinear; its base weight is `<name>.weight`, its adapters `<name>.lora_A.weight` and `<name>.lora_B.weight`."""
    return {hf_name(name): module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def adapter_names(model: nn.Module) -> dict[str, tuple[str, str, float]]:
    """HF name of each adapted base weight -> (HF-style names of its A and B, scaling): what an offline reader of a
    checkpoint merges (checkpoint.checkpoint_to_hf)."""
    return {f"{name}.weight": (*shared.adapter_names(name), module.scaling)
            for name, module in adapters_by_module(model).items()}


def adapters_by_weight(model: nn.Module) -> dict[str, LoRALinear]:
    """HF name of each adapted base weight -> its LoRALinear (export merges the adapter into that weight)."""
    return {f"{name}.weight": module for name, module in adapters_by_module(model).items()}


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(HF-style name, full tensor) of every adapter's A and B, float32 as trained, one all-gather at a time under
    FSDP: every rank must consume it."""
    for name, module in adapters_by_module(model).items():
        for adapter, hf_adapter in zip(ADAPTER_NAMES, shared.adapter_names(name)):
            yield hf_adapter, full_tensor(getattr(module, adapter).weight)


def peft_adapter_config(model: nn.Module, cfg: LoRAConfig, base_model: str) -> dict[str, object]:
    """adapter_config.json of the model's adapters (rl_core.lora.peft_adapter_config), the adapted modules in peft's
    spelling among all the model's modules."""
    others = {hf_name(name) for name, _ in model.named_modules()}
    return shared.peft_adapter_config(cfg, base_model, shared.peft_target_modules(adapters_by_module(model), others))
