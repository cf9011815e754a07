"""`convert_hf_to_mcore` and `convert_mcore_to_hf`: streaming, atomic checkpoint conversion.

Both directions walk the model one mcore tensor at a time in layer order (mapping.py decides names and
layouts, dist_format.py the megatron files, hf_io.py the safetensors files). Inputs are validated from
headers before anything is written; output goes to a temporary sibling directory renamed into place at
the end, so a failed run leaves nothing behind. The model config is saved beside the megatron checkpoint
as `ckpt_convert.json` (incl. the full HF config), which is what mcore2hf and the megatron engine read. A
Megatron-engine LoRA checkpoint holds the adapters alone and lists them there, with the base model they were trained
on (its HF directory and fingerprint): mcore2hf converts the base weights from that directory (or `base_model`) as
the engine loaded them, merges each adapter into its HF weight (rl_core.lora.merge_named, as the engine's export) and
writes the adapters in PEFT format too (rl_core.lora.ADAPTER_DIR).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ckpt_convert.dist_format import (
    CheckpointReader,
    Chunk,
    checkpoint_key,
    extra_state_chunk,
    write_checkpoint,
)
from ckpt_convert.hf_io import HFSource, write_hf_checkpoint
from ckpt_convert.mapping import hf_names_for, hf_to_mcore_tensor, mcore_names, mcore_to_hf_tensors
from ckpt_convert.mcore_model import (
    MCoreModelConfig,
    hf_architecture,
    load_hf_config,
    mcore_model_config,
    read_json,
)
from rl_core.checkpoint_io import atomic_dir, write_manifest
from rl_core.lora import BaseModel, adapter_names, checked_base_model, merge_named, write_adapter_dir

logger = logging.getLogger(__name__)

CONFIG_NAME = "ckpt_convert.json"
BASE_MODEL_OPTION = "--base-model DIR (ckpt-convert mcore2hf; MegatronEngine.checkpoint_to_hf: model_dir)"
HF_FILES_DIR = "hf_files"  # tokenizer, generation config...: copied through both directions
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# local-spec MoE layers store the pre-MLP norm under this key, TE-spec ones under pre_mlp_layernorm.weight
_MOE_NORM_ALIAS = ("decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight")


@dataclass
class ConversionSummary:
    tensors: int
    parameters: int
    seconds: float
    output_bytes: int
    path: Path

    def __str__(self) -> str:
        return (f"wrote {self.path}: {self.tensors} tensors, {self.parameters:,} parameters, "
                f"{self.output_bytes / 2**20:.1f} MiB in {self.seconds:.1f} s")


def new_output_dir(out_dir: Path) -> Path:
    """`out_dir`, refused if it exists (a conversion never overwrites what a user already has)."""
    if out_dir.exists():
        raise ValueError(f"output directory {out_dir} already exists; remove it or choose another --out")
    return out_dir


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_model_config(ckpt_dir: str | os.PathLike, hf_config: Any, cfg: MCoreModelConfig, *, tp: int = 1,
                      pp: int = 1, ep: int = 1, dtype: str = "fp32", lora: dict[str, Any] | None = None) -> Path:
    """Write `ckpt_convert.json` (HF config + layout, and a LoRA run's adapters: `convert_mcore_to_hf`) beside a
    megatron checkpoint; mcore2hf needs it."""
    path = Path(ckpt_dir) / CONFIG_NAME
    path.write_text(json.dumps({
        "format": "ckpt-convert/1", "arch": cfg.arch, "hf_config": hf_config.to_dict(),
        "vocab_size": cfg.vocab_size, "hf_vocab_size": cfg.hf_vocab_size, "dtype": dtype,
        "tp": tp, "pp": pp, "ep": ep, **({"lora": lora} if lora else {})}, indent=2, default=str))
    return path


def save_conversion_metadata(ckpt_dir: str | os.PathLike, hf_config: Any, cfg: MCoreModelConfig,
                             hf_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1, ep: int = 1,
                             lora: dict[str, Any] | None = None) -> None:
    """`ckpt_convert.json` and the HF side files (tokenizer...) beside a megatron checkpoint written by
    another tool (the Megatron engine's save_checkpoint), so that mcore2hf converts it. `lora` (a LoRA run, whose
    checkpoint holds the adapters alone): `scaling`, `adapters` (HF adapter name, rl_core.lora.adapter_names ->
    megatron parameter name), `adapter_config` (adapter_config.json), `base_model` (rl_core.lora.BaseModel.to_dict:
    the HF directory of the frozen base and its fingerprint) and `base_dtype` (the engine's parameter dtype)."""
    save_model_config(ckpt_dir, hf_config, cfg, tp=tp, pp=pp, ep=ep, lora=lora)
    _copy_hf_files(Path(hf_dir), Path(ckpt_dir) / HF_FILES_DIR)


def load_model_config(ckpt_dir: str | os.PathLike, **kwargs: Any) -> tuple[Any, MCoreModelConfig]:
    """(HF config, MCoreModelConfig) of a converted checkpoint; kwargs go to `mcore_model_config` (tp...)."""
    from transformers import AutoConfig

    saved = _read_conversion_metadata(ckpt_dir)
    hf_dict = dict(saved["hf_config"])
    hf_architecture(hf_dict)
    hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    kwargs.setdefault("vocab_size", saved["vocab_size"])
    return hf_config, mcore_model_config(hf_config, **kwargs)


def _read_conversion_metadata(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(ckpt_dir) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found: --mcore must be a checkpoint written by `ckpt-convert hf2mcore` "
                         "or MegatronEngine.save_checkpoint (or one with ckpt_convert.convert.save_model_config "
                         "beside it)")
    return read_json(path)


def saved_layout(ckpt_dir: str | os.PathLike) -> dict[str, int]:
    """The parallel layout (`tp`, `pp`, `ep`) a checkpoint's `ckpt_convert.json` records it was written at."""
    saved = _read_conversion_metadata(ckpt_dir)
    return {key: int(saved.get(key, 1)) for key in ("tp", "pp", "ep")}


def saved_lora(ckpt_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The `lora` section of a checkpoint's `ckpt_convert.json` (None: no adapters); ValueError for one written
    before LoRA checkpoints held the adapters alone (no base model recorded)."""
    lora = _read_conversion_metadata(ckpt_dir).get("lora")
    if lora is not None and "base_model" not in lora:
        raise ValueError(f"{Path(ckpt_dir) / CONFIG_NAME} records no base model for its LoRA adapters: {ckpt_dir} was "
                         "written before LoRA checkpoints held the adapters only; resume or convert it with the "
                         "version that wrote it")
    return lora


def _plan_chunks(cfg: MCoreModelConfig, source: HFSource, dtype: torch.dtype) -> tuple[list[Chunk], dict]:
    """Every chunk of the output (validated on meta tensors, so shape errors come before any write)."""
    tc = cfg.transformer_config
    chunks, name_of = [], {}
    needed = set()
    for name in mcore_names(cfg):
        sources = hf_names_for(cfg, name)
        needed.update(sources)
        shape = tuple(hf_to_mcore_tensor(cfg, name, {h: source.meta(h) for h in sources if h in source.shapes}).shape)
        key, prefix, prefix_shape = checkpoint_key(name, tc.num_layers, tc.num_moe_experts)
        group = prefix[0] + 1 if prefix else (0 if name.startswith("embedding") else tc.num_layers + 1)
        keys = _MOE_NORM_ALIAS if key == _MOE_NORM_ALIAS[0] else (key,)
        for k in keys:
            chunk = Chunk(k, prefix_shape + shape, prefix + (0,) * len(shape), (1,) * len(prefix) + shape,
                          dtype, group)
            chunks.append(chunk)
            name_of[chunk] = name
        extra = extra_state_chunk(key, prefix, prefix_shape, group)
        if extra is not None:
            chunks.append(extra)
    unknown = sorted(set(source.shapes) - needed - ({"lm_head.weight"} if cfg.share_embeddings_and_output_weights
                                                    else set()))
    if unknown:
        raise ValueError(f"HF tensor(s) {unknown[:5]} are not part of a {cfg.arch} model as described by "
                         "config.json (check num_hidden_layers / num_experts / tie_word_embeddings)")
    return chunks, name_of


def convert_hf_to_mcore(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                        ep: int = 1, dtype: str | None = None) -> Path:
    """Convert an HF checkpoint to a megatron-core torch_dist checkpoint (+ ckpt_convert.json). `dtype`
    "fp32" or "bf16"; None keeps the checkpoint's (bf16 when most of its tensors are, else fp32)."""
    if dtype not in (None, *DTYPES):
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = load_hf_config(hf_dir)
    source = HFSource(hf_dir)
    if dtype is None:
        counts = Counter(source.dtypes.values())
        dtype = "bf16" if counts and counts.most_common(1)[0][0] == torch.bfloat16 else "fp32"
    cfg = mcore_model_config(hf_config, tp=tp, pp=pp, ep=ep, params_dtype=DTYPES[dtype])
    start = time.perf_counter()  # after the config: the first megatron import is not conversion time
    chunks, name_of = _plan_chunks(cfg, source, DTYPES[dtype])
    progress = tqdm(total=len(chunks), desc="hf2mcore", unit="tensor", disable=None)
    num_params = sum(source.meta(h).numel() for n in mcore_names(cfg) for h in hf_names_for(cfg, n))

    def resolve(chunk: Chunk) -> torch.Tensor | io.BytesIO:
        progress.update(1)
        if chunk.dtype is None:  # a local linear layer's _extra_state: None, which megatron saves as [None]
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            return buf
        name = name_of[chunk]
        tensor = hf_to_mcore_tensor(cfg, name, {h: source.get(h) for h in hf_names_for(cfg, name)})
        return tensor.to(chunk.dtype).reshape(chunk.sizes)

    try:
        with atomic_dir(new_output_dir(out_dir), replace=False) as tmp:
            write_checkpoint(tmp, chunks, resolve)
            save_model_config(tmp, hf_config, cfg, tp=tp, pp=pp, ep=ep, dtype=dtype)
            _copy_hf_files(hf_dir, tmp / HF_FILES_DIR)
            write_manifest(tmp)  # last; mcore2hf and the engines verify it before DCP unpickles .metadata
            output_bytes = _dir_bytes(tmp)
    finally:
        progress.close()
        source.close()
    summary = ConversionSummary(len(mcore_names(cfg)), num_params, time.perf_counter() - start, output_bytes,
                                out_dir)
    logger.info("hf2mcore %s", summary)
    return out_dir


def _copy_hf_files(src: Path, dst: Path) -> None:
    """Copy the non-weight files of an HF checkpoint (tokenizer, generation config, chat template)."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.endswith(".index.json"):
            shutil.copy2(file, dst / file.name)


class _CheckpointWeights:
    """The model weights stored in a megatron checkpoint, by mcore name."""

    def __init__(self, reader: CheckpointReader, cfg: MCoreModelConfig) -> None:
        self.reader, self.tc = reader, cfg.transformer_config

    def _source(self, name: str) -> tuple[str, tuple]:
        key, prefix, _ = checkpoint_key(name, self.tc.num_layers, self.tc.num_moe_experts)
        if key == _MOE_NORM_ALIAS[0] and not self.reader.has(key):
            key = _MOE_NORM_ALIAS[1]
        return key, prefix

    def meta(self, name: str) -> torch.Tensor:
        key, prefix = self._source(name)
        return torch.empty(self.reader.global_shape(key)[len(prefix):], dtype=self.reader.dtype(key), device="meta")

    def read(self, name: str) -> torch.Tensor:
        return self.reader.read(*self._source(name))


class _BaseModelWeights:
    """A LoRA checkpoint's frozen weights, which it does not hold: its base model's HF tensors converted as the
    engine converted and loaded them (hf2mcore's mapping, then the engine's parameter dtype `dtype`)."""

    def __init__(self, source: HFSource, cfg: MCoreModelConfig, dtype: torch.dtype) -> None:
        self.source, self.cfg, self.dtype = source, cfg, dtype

    def meta(self, name: str) -> torch.Tensor:
        sources = {h: self.source.meta(h) for h in hf_names_for(self.cfg, name) if h in self.source.shapes}
        return hf_to_mcore_tensor(self.cfg, name, sources).to(self.dtype)

    def read(self, name: str) -> torch.Tensor:
        return hf_to_mcore_tensor(self.cfg, name, {h: self.source.get(h) for h in hf_names_for(self.cfg, name)}
                                  ).to(self.dtype)


def _read_adapter(reader: CheckpointReader, tc: Any, adapters: dict[str, str], name: str) -> torch.Tensor:
    """The full adapter tensor of HF adapter name `name` (its megatron name in `adapters`) from the checkpoint."""
    key, prefix, _ = checkpoint_key(adapters[name], tc.num_layers, tc.num_moe_experts)
    return reader.read(key, prefix)


def _merged(pairs: list[tuple[str, torch.Tensor]], lora: dict[str, Any] | None,
            read_adapter: Callable[[str], torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    """The HF tensors of one megatron tensor, those with a LoRA adapter merged with it as the engine's export
    merges them (rl_core.lora.merge_named)."""
    if not lora:
        return pairs
    wanted = [n for name, _ in pairs for n in adapter_names(name.removesuffix(".weight")) if n in lora["adapters"]]
    return merge_named(pairs, {n: read_adapter(n) for n in wanted}, lora["scaling"])


def convert_mcore_to_hf(mcore_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        base_model: str | os.PathLike | None = None, max_shard_bytes: int = 2 * 2**30) -> Path:
    """Convert a megatron torch_dist checkpoint (ours, or megatron-saved at any TP/PP/EP) back to HF. A LoRA
    checkpoint (the adapters alone): its base weights from `base_model` (default: the base directory it records,
    whose fingerprint `base_model` must have), the adapters merged, and written in PEFT format beside the weights."""
    mcore_dir, out_dir = Path(mcore_dir), Path(out_dir)
    reader = CheckpointReader(mcore_dir)
    lora = saved_lora(mcore_dir)
    if lora:  # the embedding's padded rows are the checkpoint's only where it holds the embedding
        hf_config, cfg = load_model_config(mcore_dir)
        base = checked_base_model(BaseModel.from_dict(lora["base_model"]), base_model, mcore_dir, BASE_MODEL_OPTION)
        weights = _BaseModelWeights(HFSource(base.path), cfg, getattr(torch, lora["base_dtype"]))
    else:
        hf_config, cfg = load_model_config(
            mcore_dir, vocab_size=reader.global_shape("embedding.word_embeddings.weight")[0])
        weights = _CheckpointWeights(reader, cfg)
    start = time.perf_counter()
    names = mcore_names(cfg)
    # HF (name, shape, dtype) per mcore tensor, from meta tensors: no data read yet
    plan = [[(n, tuple(t.shape), t.dtype) for n, t in mcore_to_hf_tensors(cfg, hf_config, name, weights.meta(name))]
            for name in names]
    read_adapter = functools.partial(_read_adapter, reader, cfg.transformer_config, lora["adapters"] if lora else {})
    tensors = (pair for name in tqdm(names, desc="mcore2hf", unit="tensor", disable=None)
               for pair in _merged(mcore_to_hf_tensors(cfg, hf_config, name, weights.read(name)), lora, read_adapter))
    with atomic_dir(new_output_dir(out_dir), replace=False) as tmp:
        num_params = write_hf_checkpoint(tmp, plan, tensors, hf_config, mcore_dir / HF_FILES_DIR,
                                         max_shard_bytes=max_shard_bytes)
        if lora:  # what the engine's save_hf writes beside the merged weights
            write_adapter_dir(tmp, ((name, read_adapter(name)) for name in lora["adapters"]),
                              lora["adapter_config"])
        output_bytes = _dir_bytes(tmp)
    # the HF tensors written (megatron's fused qkv / gate-up tensors are several HF ones each)
    summary = ConversionSummary(sum(map(len, plan)), num_params, time.perf_counter() - start, output_bytes, out_dir)
    logger.info("mcore2hf %s", summary)
    return out_dir
