"""Hugging Face safetensors checkpoints, read and written one tensor at a time.

`HFSource` indexes a checkpoint by its safetensors headers (names, shapes, dtypes; no data; safetensors
itself validates each file) and reads one tensor on demand with a plain seek + read. Not through
safetensors' memory map: mapped pages that were read stay in the resident set while the file is open,
so a mapped shard would count fully against the "one shard plus one layer" memory bound.
`HFShardWriter` writes shards planned from shapes alone, appending each tensor as it is produced;
`write_hf_checkpoint` adds config and tokenizer files around it (mcore2hf and the Megatron engine's save_hf).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX_NAME = "model.safetensors.index.json"
WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class HFSource:
    """The tensors of an HF checkpoint directory: names -> (file, shape, dtype), read lazily."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.path = Path(hf_dir)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {self.path}; convert .bin checkpoints with "
                             "transformers' save_pretrained(safe_serialization=True) first")
        self.files = files
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for file in files:
            with self._open(file) as handle:
                for name in handle.keys():
                    info = handle.get_slice(name)
                    if info.get_dtype() not in SAFETENSORS_DTYPES:
                        raise ValueError(f"{file.name}: tensor {name!r} has dtype {info.get_dtype()}; "
                                         f"supported: {sorted(SAFETENSORS_DTYPES)}")
                    self.where[name] = file
                    self.shapes[name] = tuple(info.get_shape())
                    self.dtypes[name] = SAFETENSORS_DTYPES[info.get_dtype()]
        self._offsets: dict[str, tuple[int, int]] = {}
        for file in files:
            self._offsets.update(_data_offsets(file))

    @staticmethod
    def _open(file: Path):  # noqa: ANN205 - safetensors' handle type is private
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file} is not a valid safetensors file ({err}); re-download or re-save "
                             "the checkpoint") from err

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype (for planning without reading data)."""
        return torch.empty(self.shapes[name], dtype=self.dtypes[name], device="meta")

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor from its file (no memory map: only this tensor becomes resident)."""
        begin, end = self._offsets[name]
        buf = bytearray(end - begin)
        with open(self.where[name], "rb") as f:
            f.seek(begin)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{self.where[name]}: tensor {name!r} is truncated; the file is corrupt")
        if not buf:
            return torch.empty(self.shapes[name], dtype=self.dtypes[name])
        return torch.frombuffer(buf, dtype=self.dtypes[name]).reshape(self.shapes[name])

    def close(self) -> None:
        """Nothing stays open between reads (kept for symmetry with writers)."""


def _data_offsets(file: Path) -> dict[str, tuple[int, int]]:
    """Absolute (begin, end) byte offsets of every tensor, from the safetensors header."""
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {name: (base + info["data_offsets"][0], base + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


_DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class HFShardWriter:
    """Streams named tensors into safetensors shards planned in advance, so nothing is buffered.

    `plan` lists groups of (name, shape, dtype) in write order; a group (the HF tensors of one mcore
    tensor) never straddles two shards. Each shard's header is written when the shard is opened, then
    tensors are appended as they arrive, in plan order.
    """

    def __init__(self, out_dir: Path, plan: list[list[tuple[str, tuple[int, ...], torch.dtype]]],
                 max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for group in plan:
            group_bytes = sum(torch.Size(s).numel() * d.itemsize for _, s, d in group)
            if shards[-1] and size + group_bytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].extend(group)
            size += group_bytes
        count = len(shards)
        self.file_names = (["model.safetensors"] if count == 1 else
                           [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        self._queue = [(name, shape, dtype, i) for i, shard in enumerate(shards) for name, shape, dtype in shard]
        self._shards = shards
        self._pos = 0
        self._file = None
        self._file_index = -1
        self.total_bytes = 0
        self.num_params = 0

    def _open_shard(self, index: int) -> None:
        self.close()
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in self._shards[index]:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
        self._file = open(self.out_dir / self.file_names[index], "wb")  # noqa: SIM115 - closed in close()
        self._file.write(len(blob).to_bytes(8, "little") + blob)
        self._file_index = index

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._queue):
            raise ValueError(f"HF tensor {name!r} was not planned (all {len(self._queue)} planned tensors written)")
        expected, shape, dtype, shard = self._queue[self._pos]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected, shape, dtype):
            raise ValueError(f"HF tensor {name!r} {tuple(tensor.shape)} {tensor.dtype} arrived where "
                             f"{expected!r} {shape} {dtype} was planned")
        if shard != self._file_index:
            self._open_shard(shard)
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()  # an engine's export may be on a GPU
        if data.numel():
            self._file.write(memoryview(data.numpy()))
        self._pos += 1
        self.total_bytes += data.numel()
        self.num_params += tensor.numel()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> list[str]:
        """Close the last shard and write the index (for more than one shard)."""
        self.close()
        if self._pos != len(self._queue):
            raise ValueError(f"only {self._pos} of {len(self._queue)} planned HF tensors were written")
        if len(self.file_names) > 1:
            weight_map = {name: self.file_names[i] for name, _, _, i in self._queue}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return self.file_names


def write_hf_checkpoint(out_dir: Path, plan: list[list[tuple[str, tuple[int, ...], torch.dtype]]],
                        tensors: Iterable[tuple[str, torch.Tensor]], hf_config: Any, side_files: Path | None,
                        *, max_shard_bytes: int = 2 * 2**30) -> int:
    """A loadable HF model directory in the existing, empty `out_dir`: the `plan`ned tensors streamed into
    safetensors shards, config.json, and the non-weight files of `side_files` (tokenizer, generation
    config). Returns the number of parameters written."""
    writer = HFShardWriter(out_dir, plan, max_shard_bytes)
    try:
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.finish()
    finally:
        writer.close()
    dtypes = {dtype for group in plan for _, _, dtype in group}
    hf_config.dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    hf_config.save_pretrained(out_dir)
    if side_files is not None and side_files.is_dir():
        for file in side_files.iterdir():
            if file.is_file() and not file.name.endswith(WEIGHT_FILE_SUFFIXES) and file.name != "config.json":
                shutil.copy2(file, out_dir / file.name)
    return writer.num_params
