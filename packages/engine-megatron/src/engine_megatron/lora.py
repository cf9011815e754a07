"""LoRA in the Megatron engine by HF module: which adapters a model gets and what they are called.

The Megatron engine trains the DTensor engine's adapters ("canonical" LoRA, rl_core.lora): one adapter per Hugging
Face linear module, although megatron fuses q/k/v into `linear_qkv` and gate/up into `linear_fc1`. This module owns
the correspondence: the HF modules each megatron linear holds (ckpt-convert's mapping, in its fused order), the
selection of targets by HF name (the same patterns select the same modules in both engines), the parameter names of
the adapters (`decoder.layers.3.self_attention.linear_qkv.lora.q_proj.lora_A`) and their HF/peft names
(`model.layers.3.self_attn.q_proj.lora_A.weight`), and the PEFT adapter config. The layers that compute the update
are lora_layers.py's (megatron imported there); export merges in model.py, checkpoints in checkpoint.py.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_convert.mapping import hf_names_for
from rl_core import lora as shared
from rl_core.config import ConfigError

# the megatron linears of a decoder layer that get adapters, in HF module order, and how megatron splits them over TP
LINEARS = {"self_attention.linear_qkv": "column", "self_attention.linear_proj": "row",
           "mlp.linear_fc1": "column", "mlp.linear_fc2": "row"}
_ADAPTER_RE = re.compile(r"^(decoder\.layers\.\d+\.[\w.]+)\.lora\.(\w+)\.lora_([AB])$")


def hf_modules(model_cfg: Any, layer: int, linear: str) -> list[str]:
    """The HF modules (`model.layers.3.self_attn.q_proj`) megatron linear `linear` of global layer `layer` fuses, in
    its fused order."""
    return [name.removesuffix(".weight") for name in hf_names_for(model_cfg, f"decoder.layers.{layer}.{linear}.weight")]


def leaf(module: str) -> str:
    """`q_proj` of `model.layers.3.self_attn.q_proj`: the name of its adapter inside the megatron linear."""
    return module.rsplit(".", 1)[-1]


def candidate_modules(model_cfg: Any) -> list[str]:
    """Every HF linear module of the decoder layers, in HF module order (per layer q, k, v, o, gate, up, down): the
    DTensor engine's order, in which both engines draw the initial A."""
    return [module for layer in range(model_cfg.transformer_config.num_layers) for linear in LINEARS
            for module in hf_modules(model_cfg, layer, linear)]


def select_targets(model_cfg: Any, cfg: shared.LoRAConfig) -> list[str]:
    """The HF modules that get an adapter (rl_core.lora.select_modules); ConfigError on a model with experts."""
    if model_cfg.is_moe:
        raise ConfigError(f"{cfg.key}.enabled=true: the Megatron engine has no LoRA for mixture-of-experts models "
                          f"({model_cfg.arch}: its experts, megatron MoE layers, take no adapters); train every "
                          f"weight (set {cfg.key}.enabled=false), use the DTensor engine (adapters on the attention "
                          "layers) or a dense model")
    return shared.select_modules(candidate_modules(model_cfg), cfg, model_cfg.arch)


def is_adapter(name: str) -> bool:
    """Whether a parameter or state-dict key of the GPTModel belongs to an adapter."""
    return re.search(r"\.lora\.\w+\.lora_[AB]$", name) is not None


def adapter_params(model_cfg: Any, targets: list[str]) -> dict[str, str]:
    """Global megatron name of every adapter parameter of `targets` -> its HF name (`shared.adapter_names`), in HF
    module order, A before B."""
    wanted = set(targets)
    out = {}
    for layer in range(model_cfg.transformer_config.num_layers):
        for linear in LINEARS:
            for module in hf_modules(model_cfg, layer, linear):
                if module in wanted:
                    prefix = f"decoder.layers.{layer}.{linear}.lora.{leaf(module)}"
                    out.update(zip((f"{prefix}.lora_A", f"{prefix}.lora_B"), shared.adapter_names(module)))
    return out


def hf_adapter_name(model_cfg: Any, name: str) -> str:
    """The HF name of adapter parameter `name` (a global megatron name)."""
    base, adapter_leaf, which = _ADAPTER_RE.match(name).groups()
    layer = int(base.split(".")[2])
    module = next(m for m in hf_modules(model_cfg, layer, base.split(".", 3)[3]) if leaf(m) == adapter_leaf)
    return shared.adapter_names(module)["AB".index(which)]


def base_weight(name: str) -> str:
    """The megatron weight an adapter parameter belongs to (its merge target)."""
    return _ADAPTER_RE.match(name).group(1) + ".weight"


def peft_config(model_cfg: Any, cfg: shared.LoRAConfig, base_model: str) -> dict[str, object]:
    """adapter_config.json of the adapters: target modules in peft's spelling among the model's linear modules."""
    targets = select_targets(model_cfg, cfg)
    return shared.peft_adapter_config(cfg, base_model,
                                      shared.peft_target_modules(targets, candidate_modules(model_cfg)))


def conversion_metadata(model_cfg: Any, cfg: shared.LoRAConfig, base_model: str,
                        base: shared.BaseModel) -> dict[str, object]:
    """What an offline export (ckpt-convert mcore2hf) needs to rebuild the base of an engine checkpoint (which holds
    the adapters alone), merge the adapters and write the PEFT adapter directory: the base model (directory and
    fingerprint) and the dtype of its weights in the engine, the scaling, HF adapter name -> megatron name, and
    adapter_config.json (naming `base_model`, policy.model_name, as save_hf's does)."""
    params = adapter_params(model_cfg, select_targets(model_cfg, cfg))
    return {"base_model": base.to_dict(),
            "base_dtype": str(model_cfg.transformer_config.params_dtype).removeprefix("torch."),
            "scaling": cfg.scaling, "adapters": {hf: mcore for mcore, hf in params.items()},
            "adapter_config": peft_config(model_cfg, cfg, base_model)}
