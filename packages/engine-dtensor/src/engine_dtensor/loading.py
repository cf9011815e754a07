"""Sharded model initialisation: build on the meta device, parallelise, then stream safetensors into shards.

Owns `build_meta_model` (the HF architecture with no storage), `materialize` (storage for this rank's
shards only, then every safetensors tensor copied into its local shard, then the non-persistent buffers
such as rotary `inv_freq` recomputed) and the safetensors file listing. The order is torchtitan's: a
rank never holds the full model, only its shards plus one full tensor at a time (the one being copied)
and the pages of the file it is reading. Does not own how the model is sharded (parallelize.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from engine_dtensor.parallelize import hf_name
from rl_core.hf_layout import CheckpointLayout

logger = logging.getLogger(__name__)


def check_hf_dir(path: str) -> Path:
    """`path` as a Path; a clear error if it is not a local HF checkpoint directory."""
    if not (Path(path) / "config.json").exists():
        raise ValueError(f"policy.model_name={path!r} is not a local Hugging Face checkpoint (no config.json)")
    return Path(path)


def attention_softcap(path: str) -> float | None:
    """The checkpoint's attention logit soft-cap (Gemma 2's `attn_logit_softcapping`), None if it has none."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(str(check_hf_dir(path))), "attn_logit_softcapping", None)


def dropout_probabilities(config: Any) -> dict[str, float]:
    """The HF config's dropout probabilities above 0, by attribute (`attention_dropout`, Phi's `resid_pdrop`, ...)."""
    return {name: value for name, value in vars(config).items()
            if isinstance(value, float) and value > 0 and name.endswith(("dropout", "pdrop"))}


def build_meta_model(path: str, attn_impl: str) -> nn.Module:
    """The HF causal LM of checkpoint `path` on the meta device (shapes only), fp32 parameters, without dropout.

    Dropout off, as the Megatron engine does: the loss's logprobs must be those of `compute_logprobs` and of the
    sampler (a checkpoint's `attention_dropout` would also take packed attention off the varlen kernel on CUDA).
    `save_hf` writes the checkpoint's own probabilities back into config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(check_hf_dir(path)))
    dropouts = dropout_probabilities(config)
    if dropouts:
        logger.info("%s: training without dropout (its config.json has %s)", path,
                    ", ".join(f"{name}={value}" for name, value in dropouts.items()))
        for name in dropouts:
            setattr(config, name, 0.0)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_impl)


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of `model.safetensors.index.json`, else `*.safetensors`."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(f"{root}: no safetensors weights ({'missing ' + str(missing) if missing else 'none found'});"
                         " policy.model_name must be a Hugging Face checkpoint saved with safetensors")
    return files


def materialize(model: nn.Module, path: str, device: torch.device) -> None:
    """Give a parallelised meta model storage on `device` and load checkpoint `path` into its shards."""
    to_empty_keeping_ties(model, device)
    targets = _load_targets(model)
    layout = CheckpointLayout(model, targets)
    loaded: set[str] = set()
    with torch.no_grad():
        for file in safetensors_files(path):
            loaded |= _load_file(file, targets, layout)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"{path}: the checkpoint has no tensor for {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''} ({len(missing)} missing)")
        _init_non_persistent_buffers(model)


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`, keeping tied parameters one object: a plain `_apply` makes a new Parameter per
    module, which unties `lm_head` from `embed_tokens`; swapping the storage into each Parameter keeps it."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def _load_targets(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> parameter or persistent buffer to fill (a tied weight appears once, under its first name)."""
    targets: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        targets[hf_name(name)] = param
    non_persistent = {hf_name(n) for n, _, _ in _non_persistent_buffers(model)}
    for name, buf in model.named_buffers():
        if hf_name(name) not in non_persistent:
            targets[hf_name(name)] = buf
    return targets


def _load_file(file: Path, targets: dict[str, Tensor], layout: CheckpointLayout) -> set[str]:
    """Copy every tensor of one safetensors file into its target's local shard; returns the names done."""
    from safetensors import safe_open

    done = set()
    with safe_open(str(file), framework="pt", device="cpu") as reader:
        for key in reader.keys():
            target = targets.get(key)
            if target is None and layout.owner(key) is not None:  # a piece of a fused parameter (MoE experts)
                finished = layout.add(key, reader.get_tensor(key))
                if finished is not None:
                    name, full = finished
                    copy_into_shard(targets[name], full)
                    done.add(name)
                continue
            if target is None:
                if key.startswith("lm_head.") and "lm_head.weight" not in targets:
                    continue  # tied output embedding: the model reads the input embedding
                raise ValueError(f"{file}: tensor {key!r} is not a parameter of the model (an architecture "
                                 "mismatch between config.json and the weights)")
            full = reader.get_tensor(key)
            if tuple(full.shape) != tuple(target.shape):
                raise ValueError(f"{file}: tensor {key!r} has shape {tuple(full.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
            copy_into_shard(target, full)
            done.add(key)
            del full  # one full tensor at a time
    return done


def copy_into_shard(target: Tensor, full: Tensor) -> None:
    """target <- this rank's part of `full` (a DTensor's local shard, or all of a plain tensor)."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank cuts its own shard from the tensor it read, no communication
        local = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def _non_persistent_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(full name, owning module, attribute) of every buffer a state dict does not carry (rotary inv_freq)."""
    out = []
    for mod_name, module in model.named_modules():
        for attr in sorted(getattr(module, "_non_persistent_buffers_set", ())):
            if getattr(module, attr, None) is not None:
                out.append((f"{mod_name}.{attr}" if mod_name else attr, module, attr))
    return out


def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers that are not in the checkpoint (they hold garbage after `to_empty`).

    transformers' `_init_weights` recomputes rotary embeddings' `inv_freq` / `original_inv_freq` from
    the config (what `from_pretrained` relies on too); a buffer it does not recompute is refused by name
    rather than left uninitialised (it is NaN-filled first, so a skipped one is seen).
    """
    buffers = _non_persistent_buffers(model)
    for name, module, attr in buffers:
        buf = getattr(module, attr)
        if not buf.is_floating_point():
            raise ValueError(f"non-persistent buffer {name!r} ({type(module).__name__}, {buf.dtype}) cannot be "
                             "initialised on the meta device by the DTensor engine")
        buf.fill_(float("nan"))
    for module in {id(m): m for _, m, _ in buffers}.values():
        _init_weights_keeping_params(model, module)
    for name, module, attr in buffers:
        if torch.isnan(getattr(module, attr)).any():
            raise ValueError(f"non-persistent buffer {name!r} ({type(module).__name__}) is not recomputed by "
                             "transformers' _init_weights; the DTensor engine cannot initialise this model "
                             "on the meta device")


def _init_weights_keeping_params(model: nn.Module, module: nn.Module) -> None:
    """`model._init_weights(module)` for the module's buffers only: it also re-draws the module's own
    parameters, which already hold the checkpoint (Gemma's embedding owns the `embed_scale` buffer, so its
    loaded weights would be replaced by random ones)."""
    loaded = [(param, param.detach().clone()) for param in module.parameters()]
    model._init_weights(module)
    for param, value in loaded:
        param.detach().copy_(value)
