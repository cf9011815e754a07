"""Check a Hugging Face checkpoint directory before any worker loads it, in about a second.

What a worker would otherwise find minutes later inside a Ray error, or not at all: a `model_type`
transformers does not know, a truncated `.safetensors` file, a tensor missing from the checkpoint (the
model would silently initialise it at random and train it), a tensor of the wrong shape, missing
tokenizer files. The architecture is built on the meta device (no memory, no weights) from config.json
and compared with the safetensors headers, which are read without reading any tensor data.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

from rl_core.config import ConfigError

logger = logging.getLogger(__name__)

KEY = "policy.model_name"
# Any one of these is a tokenizer transformers can load (fast JSON, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def read_safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of one file; ConfigError if the header or any tensor's data is cut short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: truncated safetensors file ({size} bytes, no header); re-download or re-save it")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ConfigError(f"{path}: truncated safetensors file (header of {header_len} bytes, file of {size}); "
                              "re-download or re-save it")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: corrupt safetensors header ({exc}); re-download or re-save it") from None
    tensors = {}
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        numel = 1
        for dim in info["shape"]:
            numel *= dim
        if end > data_size:
            raise ConfigError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte {end} of the data "
                              f"section, which holds {data_size}; re-download or re-save it")
        itemsize = _DTYPE_BYTES.get(info["dtype"])
        if itemsize is not None and end - start != numel * itemsize:
            raise ConfigError(f"{path}: tensor {name!r} has {end - start} bytes for shape {info['shape']} "
                              f"{info['dtype']}; the file is corrupt")
        tensors[name] = (info["dtype"], tuple(info["shape"]))
    return tensors


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [model_dir / name for name in sorted(set(weight_map.values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # truncated; no or a malformed weight_map
            raise ConfigError(f"{index}: not a sharded-checkpoint index (a JSON object whose 'weight_map' maps "
                              f"tensor names to files): {type(exc).__name__}: {exc}; re-save or re-download the "
                              "checkpoint") from None
        for path in files:
            if not path.is_file():
                raise ConfigError(f"{KEY}: {path} is listed in {index.name} but missing; re-download the checkpoint")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{KEY}={str(model_dir)!r} holds no .safetensors weights; save the model with "
                          "save_pretrained(safe_serialization=True)")
    return files


def _expected_parameters(config: Any) -> tuple[Any, dict[str, tuple[int, ...]], set[str]]:
    """(the meta-device model, name -> shape of every persistent tensor, names that tied weights may omit)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        output = model.get_output_embeddings()
        tied = {name for name, p in model.named_parameters(remove_duplicate=False)
                if output is not None and p is output.weight}
    return model, shapes, tied


def _model_names(model: Any, checkpoint: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Checkpoint tensors under the model's names, through transformers' own load-time renames and merges
    (e.g. per-expert MoE weights stacked into one tensor): ({name: shape}, {merged name: numel of its parts})."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:  # a transformers without load-time conversions: names are the model's
        return dict(checkpoint), {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    plain: dict[str, tuple[int, ...]] = {}
    merged: dict[str, int] = {}
    for name, shape in checkpoint.items():
        target, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, shapes)
        if converter is None:
            plain[target] = shape
        else:
            merged[target] = merged.get(target, 0) + math.prod(shape)
    return plain, merged


def check_model_dir(model_dir: str | Path) -> None:
    """Raise ConfigError naming the file and the fix unless `model_dir` is a complete HF checkpoint."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{config_path} is not valid JSON ({exc}); re-save the model's config") from None
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{config_path}: model_type={model_type!r} is not an architecture transformers knows; "
                          "fix model_type or install a transformers version that has it")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{KEY}={str(model_dir)!r} has no tokenizer (none of {list(TOKENIZER_FILES)}); save the "
                          "tokenizer next to the weights with tokenizer.save_pretrained(dir)")
    present: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(model_dir):
        present.update({name: shape for name, (_, shape) in read_safetensors_header(path).items()})
    # ValueError, TypeError, OSError, and huggingface_hub's strict-dataclass errors (a field of the wrong type, e.g.
    # "num_hidden_layers": "2"), which derive from none of them
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as exc:
        raise ConfigError(f"{config_path}: transformers cannot read it ({type(exc).__name__}: {exc})") from None
    model, expected, tied = _expected_parameters(config)
    present, merged = _model_names(model, present, expected)
    missing = sorted(set(expected) - set(present) - set(merged) - tied)
    if missing:
        raise ConfigError(f"{KEY}={str(model_dir)!r}: the checkpoint lacks {len(missing)} tensor(s) of the "
                          f"{model_type} architecture, e.g. {missing[:3]}; they would start from random values. "
                          "Re-save the full model")
    for name, shape in expected.items():
        if name in merged and merged[name] != math.prod(shape):
            raise ConfigError(f"{KEY}={str(model_dir)!r}: the checkpoint tensors that make up {name!r} hold "
                              f"{merged[name]} values, the architecture needs {math.prod(shape)} ({list(shape)}); "
                              "a piece is missing or has the wrong shape. Re-save the full model")
        if name in present and present[name] != shape:
            raise ConfigError(f"{KEY}={str(model_dir)!r}: tensor {name!r} has shape {list(present[name])} in the "
                              f"checkpoint but {list(shape)} in config.json's architecture; the weights and "
                              "config.json do not belong together")
    extra = sorted((set(present) | set(merged)) - set(expected))
    if extra:
        logger.warning("%s: %d checkpoint tensor(s) not in the architecture are ignored, e.g. %s", model_dir,
                       len(extra), extra[:3])
