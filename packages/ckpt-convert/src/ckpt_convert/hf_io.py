"""Hugging Face safetensors checkpoints, read and written one tensor at a time.

`HFSource` indexes a checkpoint by its safetensors headers (names, shapes, dtypes; no data) and reads a
tensor on demand, keeping at most one shard file open: an open safetensors file is memory-mapped, and
its touched pages count in the resident set, so holding every shard open would defeat streaming.
`HFShardWriter` buffers tensors up to a shard size and flushes them, then writes the index.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
INDEX_NAME = "model.safetensors.index.json"


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
        self._handle = None
        self._handle_file: Path | None = None

    @staticmethod
    def _open(file: Path):  # noqa: ANN205 - safetensors' handle type is private
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file} is not a valid safetensors file ({err}); re-download or re-save "
                             "the checkpoint") from err

    @property
    def largest_file_bytes(self) -> int:
        return max(f.stat().st_size for f in self.files)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the stored shape and dtype (for planning without reading data)."""
        return torch.empty(self.shapes[name], dtype=self.dtypes[name], device="meta")

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (switching the single open shard if needed)."""
        file = self.where[name]
        if self._handle_file != file:
            self.close()
            self._handle = self._open(file).__enter__()
            self._handle_file = file
        try:
            return self._handle.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({err}); the file is corrupt") from err

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._handle_file = None, None


class HFShardWriter:
    """Writes named tensors into safetensors shards of at most `max_shard_bytes`, then the index."""

    def __init__(self, out_dir: Path, max_shard_bytes: int) -> None:
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0
        self.num_params = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + size > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += size
        self.total_bytes += size
        self.num_params += tensor.numel()

    def _flush(self) -> None:
        save_file(self._buffer, str(self.out_dir / f"shard-{len(self._shards)}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def finish(self) -> list[str]:
        """Flush, give the shards their final names (model.safetensors or model-0000i-of-0000n), index."""
        if self._buffer:
            self._flush()
        count = len(self._shards)
        names = (["model.safetensors"] if count == 1 else
                 [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])
        weight_map = {}
        for i, (final, tensors) in enumerate(zip(names, self._shards)):
            os.rename(self.out_dir / f"shard-{i}.tmp", self.out_dir / final)
            weight_map.update(dict.fromkeys(tensors, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return names
