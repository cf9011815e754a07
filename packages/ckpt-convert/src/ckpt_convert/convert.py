"""`convert_hf_to_mcore` and `convert_mcore_to_hf`: streaming, atomic checkpoint conversion.

Both directions walk the model one mcore tensor at a time in layer order (mapping.py decides names and
layouts, dist_format.py the megatron files, hf_io.py the safetensors files). Inputs are validated from
headers before anything is written; output goes to a temporary sibling directory renamed into place at
the end, so a failed run leaves nothing behind. The model config is saved beside the megatron checkpoint
as `ckpt_convert.json` (incl. the full HF config), which is what mcore2hf and the megatron engine read. A
Megatron-engine LoRA checkpoint lists its adapters there: mcore2hf merges each into its HF weight
(rl_core.lora.merge_named, as the engine's export) and writes them in PEFT format too (rl_core.lora.ADAPTER_DIR).
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
from rl_core.lora import adapter_names, merge_named, write_adapter_dir

logger = logging.getLogger(__name__)

CONFIG_NAME = "ckpt_convert.json"
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
    another tool (the Megatron engine's save_checkpoint), so that mcore2hf converts it. `lora` (a LoRA run):
    `scaling`, `adapters` (HF adapter name, rl_core.lora.adapter_names -> megatron parameter name) and
    `adapter_config` (adapter_config.json)."""
    save_model_config(ckpt_dir, hf_config, cfg, tp=tp, pp=pp, ep=ep, lora=lora)
    _copy_hf_files(Path(hf_dir), Path(ckpt_dir) / HF_FILES_DIR)


def load_model_config(ckpt_dir: str | os.PathLike, **kwargs: Any) -> tuple[Any, MCoreModelConfig]:
    """(HF config, MCoreModelConfig) of a converted checkpoint; kwargs go to `mcore_model_config` (tp...)."""
    from transformers import AutoConfig

    path = Path(ckpt_dir) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{path} not found: --mcore must be a checkpoint written by `ckpt-convert hf2mcore` "
                         "or MegatronEngine.save_checkpoint (or one with ckpt_convert.convert.save_model_config "
                         "beside it)")
    saved = read_json(path)
    hf_dict = dict(saved["hf_config"])
    hf_architecture(hf_dict)
    hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
    kwargs.setdefault("vocab_size", saved["vocab_size"])
    return hf_config, mcore_model_config(hf_config, **kwargs)


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


def _checkpoint_source(reader: CheckpointReader, name: str, tc: Any) -> tuple[str, tuple]:
    key, prefix, _ = checkpoint_key(name, tc.num_layers, tc.num_moe_experts)
    if key == _MOE_NORM_ALIAS[0] and not reader.has(key):
        key = _MOE_NORM_ALIAS[1]
    return key, prefix


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
                        max_shard_bytes: int = 2 * 2**30) -> Path:
    """Convert a megatron torch_dist checkpoint (ours, or megatron-saved at any TP/PP/EP) back to HF; a LoRA
    checkpoint's adapters merged, and written in PEFT format beside the weights."""
    mcore_dir, out_dir = Path(mcore_dir), Path(out_dir)
    reader = CheckpointReader(mcore_dir)
    hf_config, cfg = load_model_config(
        mcore_dir, vocab_size=reader.global_shape("embedding.word_embeddings.weight")[0])
    start = time.perf_counter()
    tc = cfg.transformer_config
    names = mcore_names(cfg)
    sources = [_checkpoint_source(reader, name, tc) for name in names]
    plan = []  # HF (name, shape, dtype) per mcore tensor, from meta tensors: no data read yet
    for name, (key, prefix) in zip(names, sources):
        meta = torch.empty(reader.global_shape(key)[len(prefix):], dtype=reader.dtype(key), device="meta")
        plan.append([(n, tuple(t.shape), t.dtype) for n, t in mcore_to_hf_tensors(cfg, hf_config, name, meta)])
    lora = read_json(mcore_dir / CONFIG_NAME).get("lora")  # absent: no adapters
    read_adapter = functools.partial(_read_adapter, reader, tc, lora["adapters"] if lora else {})
    tensors = (pair for name, (key, prefix) in zip(tqdm(names, desc="mcore2hf", unit="tensor", disable=None), sources)
               for pair in _merged(mcore_to_hf_tensors(cfg, hf_config, name, reader.read(key, prefix)), lora,
                                   read_adapter))
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
