"""LoRA pieces that do not depend on an engine: the config schema, the adapters' initial values, the merge, target
selection by HF module name, the PEFT adapter format, the KL reference of a LoRA run (the base model), and the base
model's fingerprint: a LoRA engine checkpoint holds the adapters alone, and the base they were trained on is rebuilt
from its HF directory, which must be that same base.

Both engines put one adapter on each selected Hugging Face linear module (`model.layers.0.self_attn.q_proj`), A
(dim, in) and B (out, dim), whatever their own module layout (the Megatron engine fuses q/k/v and gate/up), so that
one `lora_cfg` trains the same model in either engine: the same modules selected by the same patterns, the same
initial A (drawn full-size from one seeded generator in HF module order), B zero, and the same merge
W + alpha/dim * B @ A. Does not own the layers that compute the update, their sharding or checkpoints (the engines').
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn

from rl_core.config import ConfigError

# Adapter initialisation draws full tensors from this seed in HF module order on every rank, so that any layout
# (and either engine) starts from the same A.
INIT_SEED = 0
# The adapters alone in PEFT format, inside an HF directory of a LoRA run (beside the merged weights, which weight
# loaders read from the top level only): the adapter applies to the base model its adapter_config.json names.
ADAPTER_DIR = "adapter"
PEFT_PREFIX = "base_model.model."  # peft's key of the wrapped *ForCausalLM in adapter_model.safetensors
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # what a base model's fingerprint covers
FINGERPRINT_EDGE_BYTES = 1 << 20  # bytes of data hashed at each end of a weight file


@dataclass(kw_only=True)
class LoRAConfig:
    """An engine's `lora_cfg`: low-rank adapters trained on frozen base weights, so that the optimizer state and
    gradients cover the adapters only. Each engine subclasses it with its own `key` (where users write it), which
    the error messages name."""

    key: ClassVar[str] = "lora_cfg"
    enabled: bool = False
    dim: int = 8  # the rank r of B (out, r) @ A (r, in)
    alpha: float = 32.0  # the update is scaled by alpha / dim
    dropout: float = 0.0  # on the adapter's input only
    # empty: every linear module of the decoder layers; else HF leaf names (`q_proj`) or globs on full HF module
    # names (`model.layers.0.self_attn.q_proj`)
    target_modules: list[str] = field(default_factory=list)
    exclude_modules: list[str] = field(default_factory=list)  # same matching, applied after target_modules

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ConfigError(f"{self.key}.dim must be >= 1 (the adapter rank); got {self.dim}")
        if not self.alpha > 0:
            raise ConfigError(f"{self.key}.alpha must be > 0 (the update is scaled by alpha / dim); got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"{self.key}.dropout must be in [0, 1); got {self.dropout}")

    @property
    def scaling(self) -> float:
        """The factor of the low-rank update B @ A."""
        return self.alpha / self.dim


def init_lora_a(shape: tuple[int, int], generator: torch.Generator) -> Tensor:
    """A full A (dim, in) as nn.Linear's default initialisation (kaiming-uniform, a=sqrt(5)), float32: drawn whole
    and cut into shards by the caller, so that the values depend on neither the layout nor the engine."""
    full_a = torch.empty(shape, dtype=torch.float32)
    nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
    return full_a


def merge(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """W + scaling * B @ A, summed in float32 and rounded once to W's dtype."""
    return (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)


def merge_named(weights: Iterable[tuple[str, Tensor]], adapters: Mapping[str, Tensor],
                scaling: float) -> Iterator[tuple[str, Tensor]]:
    """HF (name, weight) pairs, each weight whose module has an adapter in `adapters` (HF adapter name
    (`adapter_names`) -> full A or B) merged with it (`merge`), the others as they are."""
    for name, weight in weights:
        a, b = adapter_names(name.removesuffix(".weight"))
        yield name, (merge(weight, adapters[a], adapters[b], scaling) if a in adapters else weight)


def _matches(patterns: list[str], name: str) -> list[str]:
    """The patterns that select module `name`: its leaf name exactly, or a glob on the full name."""
    leaf = name.rsplit(".", 1)[-1]
    return [p for p in patterns if p == leaf or fnmatch.fnmatchcase(name, p)]


def select_modules(linears: list[str], cfg: LoRAConfig, arch: str) -> list[str]:
    """The HF module names among `linears` (every linear module of the decoder layers of model class `arch`, in
    module order) that get an adapter; a pattern selecting nothing is an error listing the leaf names there are."""
    for key, patterns in (("target_modules", cfg.target_modules), ("exclude_modules", cfg.exclude_modules)):
        unused = [p for p in patterns if not any(_matches([p], name) for name in linears)]
        if unused:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ConfigError(
                f"{cfg.key}.{key}: {unused} match no nn.Linear in the decoder layers of {arch}; use leaf names "
                f"among {leaves} or globs on full names such as '{linears[0]}'")
    selected = [name for name in linears if (not cfg.target_modules or _matches(cfg.target_modules, name))
                and not _matches(cfg.exclude_modules, name)]
    if not selected:
        raise ConfigError(f"{cfg.key}.exclude_modules excludes every target module: no adapter would train; narrow "
                          "exclude_modules")
    return selected


def peft_target_modules(adapted: Iterable[str], others: Iterable[str]) -> list[str]:
    """The adapted modules (HF names) in peft's spelling: their leaf names (`q_proj`), as users write them, when
    those name none of the model's `others` (its modules without adapter); else every adapted module's full name (an
    exclude_modules glob that spares some layers: peft matches a full name exactly, and a leaf name in every layer)."""
    adapted = sorted(adapted)
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    spared = set(others) - set(adapted)
    return adapted if any(name.rsplit(".", 1)[-1] in leaves for name in spared) else leaves


def peft_adapter_config(cfg: LoRAConfig, base_model: str, target_modules: list[str]) -> dict[str, object]:
    """adapter_config.json of the adapters: fields of peft's LoraConfig (those vLLM reads among them) that describe
    y = W x + lora_alpha/r * B A x (no rsLoRA, DoRA or adapter bias; `base_model`'s biases stay in it). peft fills
    its other fields with their defaults."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.dim, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "use_rslora": False,
            "use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
            "target_modules": target_modules, "inference_mode": True}


def adapter_names(module: str) -> tuple[str, str]:
    """The HF-style names of the A and B of the adapter on HF module `module` (peft's, without its prefix)."""
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def write_adapter_dir(out: Path, tensors: Iterable[tuple[str, Tensor]], config: dict[str, object]) -> None:
    """`out/ADAPTER_DIR` in PEFT format: adapter_config.json and adapter_model.safetensors,
    `base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r) as given (`adapter_names`): the
    DTensor engine's float32 master weights (~80 MB for 7B at rank 8), the Megatron engine's model copy (bf16 under
    bf16); peft computes adapters in float32, vLLM casts them to the dtype it serves in."""
    from safetensors.torch import save_file

    adapter_dir = out / ADAPTER_DIR
    adapter_dir.mkdir()
    state = {PEFT_PREFIX + name: tensor.cpu().contiguous() for name, tensor in tensors}
    save_file(state, str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


@contextlib.contextmanager
def adapters_disabled(modules: list[nn.Module]) -> Iterator[None]:
    """Every module of `modules` (an engine's LoRA layers, each with an `adapter_enabled` switch) computes its base
    layer alone for the block."""
    for module in modules:
        module.adapter_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.adapter_enabled = True


class BaseModelReference:
    """The KL reference of a LoRA run: the frozen base model, the policy with its adapters off. It holds no copy
    of the weights, and after a resume it is still the base model (the checkpoint's base is frozen)."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def swapped_in(self) -> contextlib.AbstractContextManager[None]:
        """Inside the block the model computes the reference (FrozenWeights' interface)."""
        return adapters_disabled(self.modules)

    def to(self, device: torch.device | str) -> None:
        """Nothing to move: the reference is the policy's own base weights."""


def base_model_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over each weight file of HF directory `model_dir` (by name): its name, size, safetensors header (every
    tensor's name, dtype, shape and offsets) and the first and last MiB of its data. Cheap on a 16 GB model (a few
    MiB read per file, no full hash), and it tells apart another model, another shape, and the same shapes with
    other weights (a fine-tune or another seed changes nearly every weight, those at the ends of each file too); a
    change confined to the middle of a file goes unseen, the price of not reading it."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and p.name.endswith(WEIGHT_FILE_SUFFIXES))
    if not files:
        raise ValueError(f"{model_dir} holds no weight file ({', '.join(WEIGHT_FILE_SUFFIXES)}): pass the HF "
                         "directory of the base model")
    digest = hashlib.sha256()
    for file in files:
        for piece in _weight_file_sample(file):
            digest.update(piece)
    return digest.hexdigest()


def _weight_file_sample(file: Path) -> Iterator[bytes]:
    """What the fingerprint hashes of one weight file: name and size, the safetensors header, and the first and
    last FINGERPRINT_EDGE_BYTES of the data after it."""
    size = file.stat().st_size
    yield f"{file.name}\0{size}\0".encode()
    with open(file, "rb") as f:
        data_start = 0
        if file.suffix == ".safetensors" and size >= 8:  # u64 header length, the JSON header, then the data
            header_len = int.from_bytes(f.read(8), "little")
            data_start = 8 + header_len
            yield f.read(header_len)
        f.seek(data_start)
        yield f.read(FINGERPRINT_EDGE_BYTES)
        f.seek(max(data_start, size - FINGERPRINT_EDGE_BYTES))
        yield f.read(FINGERPRINT_EDGE_BYTES)


@dataclass(frozen=True, kw_only=True)
class BaseModel:
    """The base model a LoRA checkpoint's adapters were trained on: its HF directory (absolute) and fingerprint,
    saved with the checkpoint (computed once per engine, at build), checked where the base is rebuilt."""

    path: str
    fingerprint: str

    @classmethod
    def of(cls, model_dir: str | os.PathLike) -> BaseModel:
        """The record of HF directory `model_dir` (reads a few MiB per weight file)."""
        return cls(path=str(Path(model_dir).absolute()), fingerprint=base_model_fingerprint(model_dir))

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, saved: Mapping[str, str]) -> BaseModel:
        return cls(path=saved["path"], fingerprint=saved["fingerprint"])

    def check(self, current: BaseModel, checkpoint: str | os.PathLike, option: str) -> None:
        """ValueError unless `current` (the base this process rebuilt) is this base: the adapters of `checkpoint`
        would load onto another model's weights, shapes permitting, and train or export a model nobody trained.
        `option` is where the user points at another base directory."""
        if current.fingerprint != self.fingerprint:
            raise ValueError(
                f"LoRA checkpoint {checkpoint} was trained on the base model at {self.path} (fingerprint "
                f"{self.fingerprint[:12]}), but the base directory this run uses, {current.path}, holds another model "
                f"(fingerprint {current.fingerprint[:12]}): point {option} at the base the run was trained from")


def checked_base_model(saved: BaseModel, base_dir: str | os.PathLike | None, checkpoint: str | os.PathLike,
                     option: str) -> BaseModel:
    """The base model to rebuild the adapters of `checkpoint` on: `base_dir` if given, else the one it was trained
    on; ValueError naming the path and `option` if the directory is gone, or if it holds another model."""
    path = Path(base_dir if base_dir is not None else saved.path)
    if not path.is_dir():
        raise ValueError(f"the base model directory {path} of LoRA checkpoint {checkpoint} does not exist (the "
                         f"checkpoint holds the adapters only): pass the directory of that base with {option}")
    current = BaseModel.of(path)
    saved.check(current, checkpoint, option)
    return current
