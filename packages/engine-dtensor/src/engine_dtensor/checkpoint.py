"""Checkpoints and weight export of a parallelised model.

Owns: `torch.distributed.checkpoint` (DCP) save/load of model + optimizer (sharded, reshardable; a LoRA run's model
state is its adapters alone: the frozen base is rebuilt from its HF directory, whose fingerprint `LORA_FILE` records),
scheduler and per-rank RNG state (tensors and plain values: loaded with weights_only), written to
`<path>.tmp`, listed in a checksum manifest and renamed into place, so that a crash never leaves a
half-written `<path>` and a damaged one is refused before DCP unpickles its `.metadata`; on load the
optimizer settings (lr, weight decay, betas, ...) stay the configured ones, as in the Megatron engine; streaming
export of full HF-named tensors (one all-gather at a time); `save_hf` (safetensors shards + config + tokenizer
files) that `AutoModelForCausalLM.from_pretrained` loads, and `checkpoint_to_hf`, the same directory from a
checkpoint offline (one process, no process group): both go through one writer, and a LoRA run's adapters alone in
PEFT format (`ADAPTER_DIR`) through rl_core.lora's. The filesystem must be shared by all ranks (one node, or a network
filesystem).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from engine_dtensor import lora
from engine_dtensor.config import LoRAConfig
from engine_dtensor.loading import build_meta_model, dropout_probabilities, materialize
from engine_dtensor.parallelize import hf_name
from rl_core import checkpoint_io
from rl_core import lora as shared_lora
from rl_core.config import parse_config
from rl_core.lora import ADAPTER_DIR  # noqa: F401 - where save_hf puts the adapter (tests and callers read it here)

logger = logging.getLogger(__name__)

LORA_FILE = "lora.json"  # a LoRA run's checkpoint: its settings, base model and base dtype (LoRACheckpoint)
# The adapters alone in PEFT format (ADAPTER_DIR) are written with the HF directory by the same atomic commit and
# covered by its manifest (and the trainer's), so the merged model and its adapter never come from different steps.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _prepare_tmp(path: str) -> Path:
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    return tmp


def _commit(tmp: Path, path: str) -> None:
    _barrier()  # every rank has finished writing
    checkpoint_io.write_manifest_on_all_ranks(tmp)  # last: its presence says the directory is complete
    if _rank() == 0:
        checkpoint_io.publish_dir(tmp, path)
    _barrier()


@dataclasses.dataclass(frozen=True)
class LoRACheckpoint:
    """What a LoRA checkpoint records beside its adapters (`LORA_FILE`): the settings, the base model they were
    trained on, and the dtype its frozen weights had in the engine (the offline export rebuilds them alike)."""

    cfg: LoRAConfig
    base: shared_lora.BaseModel
    base_dtype: torch.dtype

    def write(self, directory: Path) -> None:
        saved = {**dataclasses.asdict(self.cfg), "base_model": self.base.to_dict(),
                 "base_dtype": str(self.base_dtype).removeprefix("torch.")}
        (directory / LORA_FILE).write_text(json.dumps(saved, indent=1))

    @classmethod
    def read(cls, checkpoint_dir: str) -> LoRACheckpoint | None:
        """The record of a LoRA run's checkpoint; None for a checkpoint of a full fine-tune."""
        file = Path(checkpoint_dir) / LORA_FILE
        if not file.is_file():
            return None
        saved = json.loads(file.read_text())
        if "base_model" not in saved:
            raise ValueError(f"{file} records no base model: {checkpoint_dir} was written before LoRA checkpoints "
                             "held the adapters only; resume or export it with the version that wrote it")
        base, dtype = shared_lora.BaseModel.from_dict(saved.pop("base_model")), getattr(torch, saved.pop("base_dtype"))
        return cls(parse_config(LoRAConfig, saved, LORA_FILE), base, dtype)


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The DCP state of model and optimizer: with LoRA the adapters alone (the optimizer holds nothing else), no
    frozen base weight: it is the base model's, which the engine loads from its HF directory."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if lora.lora_modules(model):
        model_sd = {name: tensor for name, tensor in model_sd.items() if lora.is_adapter_param(name)}
    return model_sd, optim_sd


def save_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                    lora_checkpoint: LoRACheckpoint | None = None) -> None:
    """DCP model + optimizer shards, plus scheduler and this rank's RNG state, atomically at `path`; with LoRA the
    adapters as the model state, and `lora_checkpoint` (`LORA_FILE`: what resume and offline export check and
    need to rebuild the base)."""
    tmp = _prepare_tmp(path)
    model_sd, optim_sd = _model_state(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    extra = {"scheduler": scheduler.state_dict(), "rng": checkpoint_io.rng_state()}
    torch.save(extra, tmp / f"extra_rank{_rank()}.pt")
    if lora_checkpoint is not None and _rank() == 0:
        lora_checkpoint.write(tmp)
    _commit(tmp, path)
    logger.info("saved checkpoint %s", path)


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                    lora_base: shared_lora.BaseModel | None = None) -> None:
    """Restore what `save_checkpoint` wrote (resharding to this run's layout if it differs); with LoRA the
    adapters, after checking that `lora_base` (the base this engine loaded) is the one they were trained on."""
    _verify_checkpoint(path)
    if lora_base is not None:
        _check_lora_base(path, lora_base)
    configured = _hyperparameters(optimizer, scheduler)
    model_sd, optim_sd = _model_state(model, optimizer)  # the target layout, incl. empty optimizer state
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    # LoRA: the model state is the adapters; the frozen base stays as the engine loaded it
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=not lora.lora_modules(model)))
    extra_file = Path(path) / f"extra_rank{_rank()}.pt"
    if not extra_file.exists():  # loaded at a larger world size: ranks without a file reuse rank 0's RNG
        logger.warning("%s not found (checkpoint from fewer ranks); using rank 0's RNG state", extra_file)
        extra_file = Path(path) / "extra_rank0.pt"
    extra = checkpoint_io.load_tensors(extra_file)
    scheduler.load_state_dict(extra["scheduler"])
    _restore_configured_hyperparameters(path, optimizer, scheduler, configured)
    checkpoint_io.set_rng_state(extra["rng"])
    logger.info("loaded checkpoint %s", path)


def _check_lora_base(path: str, current: shared_lora.BaseModel) -> None:
    """ValueError unless checkpoint `path` holds adapters trained on `current`, the base this run loaded."""
    saved = LoRACheckpoint.read(path)
    if saved is None:
        raise ValueError(f"{path} is a checkpoint of a full fine-tune (no {LORA_FILE}), not of a LoRA run: resume it "
                         "with policy.dtensor_cfg.lora_cfg.enabled=false")
    saved.base.check(current, path, "policy.model_name")


def _verify_checkpoint(path: str) -> None:
    """Refuse a directory that is no DTensor engine checkpoint, or a damaged one (naming the file): before
    DCP unpickles its .metadata (a missing .metadata is named too)."""
    if not (Path(path) / ".metadata").exists() and not (Path(path) / checkpoint_io.MANIFEST_FILE).exists():
        raise ValueError(f"{path!r} is not a DTensor engine checkpoint (no DCP .metadata file in it)")
    checkpoint_io.verify_manifest_on_all_ranks(path)


def _hyperparameters(optimizer: torch.optim.Optimizer, scheduler: object) -> list[dict[str, object]]:
    """Each param group's settings with the schedule's base lr (its current lr is derived), no parameters."""
    return [{**{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}, "base_lr": base_lr}
            for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs)]


def _restore_configured_hyperparameters(path: str, optimizer: torch.optim.Optimizer, scheduler: object,
                                        configured: list[dict[str, object]]) -> None:
    """The run's config, not the checkpoint, sets lr, weight decay, betas, ...: the loaded param groups and
    scheduler carry the saving run's values, which would silently override a changed policy.optimizer
    (the Megatron engine follows the config too). The schedule's position stays the checkpoint's."""
    changes = checkpoint_io.changed_settings(configured, _hyperparameters(optimizer, scheduler))
    if changes:
        logger.warning("%s was saved with other optimizer settings; the configured ones apply: %s",
                       path, ", ".join(changes))
    for group, settings, lr_lambda in zip(optimizer.param_groups, configured, scheduler.lr_lambdas):
        base_lr = settings["base_lr"]
        group.update({k: v for k, v in settings.items() if k != "base_lr"}, initial_lr=base_lr,
                     lr=base_lr * lr_lambda(scheduler.last_epoch))
    scheduler.base_lrs = [settings["base_lr"] for settings in configured]
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def _to_checkpoint_layout(model: nn.Module) -> Callable[[str, Tensor], dict[str, Tensor]]:
    """name, tensor in transformers' in-memory layout -> the on-disk HF layout (e.g. per-expert MoE)."""
    try:  # transformers >= 5 fuses some weights at load time (MoE experts) and reverts it on save
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return lambda name, tensor: {name: tensor}
    return lambda name, tensor: revert_weight_conversion(model, {name: tensor})


def _distinct_state(model: nn.Module) -> dict[str, Tensor]:
    """HF name -> parameter or persistent buffer, in the model's order; a tied weight once, under its first
    name (HF re-ties it on load); no LoRA adapter (export merges it into its base weight)."""
    seen: set[int] = set()
    out: dict[str, Tensor] = {}
    # keep_vars: the parameters themselves (a plain state_dict detaches each entry into a new object, so a
    # tied weight would pass the identity check twice and refit would send it twice)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen and not lora.is_adapter_param(name):
            seen.add(id(tensor))
            out[hf_name(name)] = tensor
    return out


def _hf_tensors(model: nn.Module, value: Callable[[str, Tensor], Tensor]) -> Iterator[tuple[str, Tensor]]:
    """`value(hf_name, tensor)` of each entry of `_distinct_state`, one at a time, in the on-disk HF layout."""
    to_checkpoint = _to_checkpoint_layout(model)
    for name, tensor in _distinct_state(model).items():
        yield from to_checkpoint(name, value(name, tensor)).items()


def export_hf_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Full tensors under HF checkpoint names, one all-gather at a time; every rank must consume it. A weight with
    a LoRA adapter is sent merged (W + scaling * B @ A), so that receivers need no LoRA support."""
    adapters = lora.adapters_by_weight(model)

    def gather(name: str, tensor: Tensor) -> Tensor:
        full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
        return adapters[name].merged_weight(full) if name in adapters else full

    return _hf_tensors(model, gather)


def save_hf(path: str, model: nn.Module, source_dir: str, lora_cfg: LoRAConfig | None = None,
            max_shard_bytes: int = 2 << 30) -> None:
    """Safetensors shards + config (+ tokenizer files copied from `source_dir`) at `path`, atomically; with LoRA
    (`lora_cfg`) the merged weights, and the adapters alone in PEFT format in `path/ADAPTER_DIR`."""
    tmp = _prepare_tmp(path)
    # all ranks gather (each tensor is a collective under FSDP); rank 0 writes
    _write_on_rank0(export_hf_weights(model), lambda weights: _write_hf_dir(tmp, weights, model, source_dir,
                                                                            max_shard_bytes))
    if lora_cfg is not None:
        config = lora.peft_adapter_config(model, lora_cfg, source_dir)
        _write_on_rank0(lora.adapter_tensors(model),
                        lambda tensors: shared_lora.write_adapter_dir(tmp, tensors, config))
    _commit(tmp, path)
    logger.info("saved HF checkpoint %s", path)


def _write_on_rank0(stream: Iterable[tuple[str, Tensor]],
                    write: Callable[[Iterable[tuple[str, Tensor]]], None]) -> None:
    """`write(stream)` on rank 0; the other ranks consume the stream (its all-gathers) and write nothing."""
    if _rank() == 0:
        write(stream)
    else:
        for _ in stream:
            pass


def checkpoint_to_hf(checkpoint_dir: str, out_dir: str, *, model_dir: str, max_shard_bytes: int = 2 << 30) -> None:
    """The model weights of a `save_checkpoint` directory (any FSDP/TP layout) as an HF model directory at
    `out_dir`, which must not exist; offline: one process, no process group, CPU, the optimizer never read.
    `model_dir` (the run's policy.model_name) gives the architecture, config and tokenizer files, and for a LoRA
    checkpoint (the adapters alone) the base weights too: then it writes what the live `save_hf` writes, the merged
    weights and the adapters in PEFT format (`ADAPTER_DIR`)."""
    if Path(out_dir).exists():
        raise ValueError(f"{out_dir} already exists; remove it or choose another output directory")
    _verify_checkpoint(checkpoint_dir)
    saved_lora = LoRACheckpoint.read(checkpoint_dir)
    if saved_lora is not None:  # before the model is built from model_dir: a missing one is named as the base
        shared_lora.checked_base_model(saved_lora.base, model_dir, checkpoint_dir,
                                       "model_dir (uv run apps/grpo export --base-model DIR)")
    model = build_meta_model(model_dir, "eager")  # names, order, ties and MoE layout; no storage
    with checkpoint_io.atomic_dir(out_dir, replace=False) as tmp:
        if saved_lora is None:
            _write_hf_dir(tmp, _checkpoint_weights(checkpoint_dir, model, model_dir), model, model_dir,
                          max_shard_bytes)
        else:
            _load_lora_model(checkpoint_dir, model, model_dir, saved_lora)
            shared_lora.write_adapter_dir(tmp, lora.adapter_tensors(model),
                                          lora.peft_adapter_config(model, saved_lora.cfg, model_dir))
            _write_hf_dir(tmp, export_hf_weights(model), model, model_dir, max_shard_bytes)  # the live exporter
        checkpoint_io.write_manifest(tmp)  # as save_hf's directories have one
    logger.info("exported %s to HF checkpoint %s", checkpoint_dir, out_dir)


def _checkpoint_weights(checkpoint_dir: str, model: nn.Module, model_dir: str) -> Iterator[tuple[str, Tensor]]:
    """The HF tensors of a full fine-tune's checkpoint, one at a time, each freed once its shard is written."""
    full = _load_model_tensors(checkpoint_dir, model, model_dir, list(_distinct_state(model)))
    return _hf_tensors(model, lambda name, tensor: full.pop(name))


def _load_lora_model(checkpoint_dir: str, model: nn.Module, model_dir: str, saved: LoRACheckpoint) -> None:
    """The meta `model` becomes the LoRA run's model on the CPU as the engine built it: adapters on the same
    modules, the frozen base loaded from `model_dir` in the engine's dtype, and the adapters from the checkpoint."""
    lora.apply_lora(model, saved.cfg, frozen_dtype=saved.base_dtype)
    with lora.adapters_detached(model):
        materialize(model, model_dir, torch.device("cpu"))
    adapters = {f"{name}.{adapter}": getattr(module, adapter) for name, module in lora.adapters_by_module(model).items()
                for adapter in lora.ADAPTER_NAMES}
    full = _load_model_tensors(checkpoint_dir, model, model_dir, [f"{name}.weight" for name in adapters])
    for name, linear in adapters.items():
        linear.weight = nn.Parameter(full.pop(f"{name}.weight"), requires_grad=False)


def _load_model_tensors(checkpoint_dir: str, model: nn.Module, model_dir: str, names: list[str]) -> dict[str, Tensor]:
    """HF name -> full tensor of each of `names` (the `_distinct_state(model)` entries, or a LoRA model's adapters),
    read from the `model.*` entries of a DCP checkpoint (no `optim.*` entry, nor a tied weight's second name, is
    read), assembled from all ranks' shards in this process. The checkpoint must hold no weight the model lacks: an
    extra one (another architecture's bias) would otherwise be dropped silently."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(checkpoint_dir)
    entries = reader.read_metadata().state_dict_metadata  # DCP keys: "model.<fqn>", "optim.<...>"
    keys = {hf_name(key.removeprefix("model.")): key for key, meta in entries.items()
            if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    missing = [name for name in names if name not in keys]
    extra = sorted(set(keys) - {hf_name(name) for name in model.state_dict()})  # tied weights under each name
    if missing or extra:
        raise ValueError(f"{checkpoint_dir} does not hold the weights of the model in model_dir={model_dir!r} "
                         f"(missing: {missing[:3]}, {len(missing)} in all; not in the model: {extra[:3]}, "
                         f"{len(extra)} in all): pass the run's policy.model_name")
    state = {keys[name]: torch.empty(entries[keys[name]].size, dtype=entries[keys[name]].properties.dtype)
             for name in names}
    with warnings.catch_warnings():  # torch warns that it assumes one process even when told so (no_dist)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {name: state[keys[name]] for name in names}


def _write_hf_dir(out: Path, weights: Iterable[tuple[str, Tensor]], model: nn.Module, source_dir: str,
                  max_shard_bytes: int) -> None:
    """`weights` streamed into safetensors shards of about `max_shard_bytes` (bounded host memory), then the
    index, config and side files: the one writer of `save_hf` and `checkpoint_to_hf`."""
    from safetensors.torch import save_file

    shard: dict[str, Tensor] = {}
    weight_map: dict[str, str] = {}
    num_bytes = num_files = 0
    float_bytes: Counter[torch.dtype] = Counter()  # the shards' dtype, for config.json

    def flush() -> None:  # write the current shard and start a new one
        nonlocal shard, num_bytes, num_files
        num_files += 1
        name = f"model-{num_files:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, num_bytes = {}, 0

    for name, tensor in weights:
        shard[name] = tensor.cpu().contiguous()
        num_bytes += tensor.numel() * tensor.element_size()
        if tensor.is_floating_point():
            float_bytes[tensor.dtype] += tensor.numel() * tensor.element_size()
        if num_bytes >= max_shard_bytes:
            flush()
    if shard or not num_files:
        flush()
    _write_index_and_config(out, weight_map, model, source_dir,
                            float_bytes.most_common(1)[0][0] if float_bytes else None)


def _write_index_and_config(tmp: Path, weight_map: dict[str, str], model: nn.Module, source_dir: str,
                            dtype: torch.dtype | None) -> None:
    """The index (several shards), config.json and the side files of `source_dir`. config.json keeps the base
    model's declared dtype (vLLM's dtype=auto serves in it: float32 master weights of a bf16 model still serve in
    bf16) unless the shards hold a narrower `dtype` (a LoRA run's bf16 frozen base on a float32 base config, which
    would be served at twice the memory)."""
    shard_names = sorted(set(weight_map.values()))
    if len(shard_names) == 1:
        os.rename(tmp / shard_names[0], tmp / "model.safetensors")
    else:
        index = {"metadata": {}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    from transformers import AutoConfig

    config = copy.deepcopy(model.config)  # the live model's own config stays as it is
    config.update(dropout_probabilities(AutoConfig.from_pretrained(source_dir)))  # the engine trains without them
    declared = getattr(config, "dtype", None)
    if dtype is not None and (not isinstance(declared, torch.dtype) or dtype.itemsize < declared.itemsize):
        config.dtype = dtype
    config.save_pretrained(tmp)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(tmp)
    for item in Path(source_dir).iterdir():  # tokenizer and other side files
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not (tmp / item.name).exists():
            shutil.copy2(item, tmp / item.name)
