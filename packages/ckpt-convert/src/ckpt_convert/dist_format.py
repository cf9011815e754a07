"""megatron-core's `torch_dist` checkpoint format, written and read one layer at a time.

A megatron distributed checkpoint is a torch.distributed.checkpoint (DCP) directory (`.metadata` plus
`*.distcp` files of torch.save'd chunks) with `metadata.json` (backend) and `common.pt` beside it. Layer
tensors are stored stacked: key `decoder.layers.<suffix>` of global shape (num_layers, *shape), experts as
`decoder.layers.mlp.experts.experts.<suffix>` of shape (num_layers, num_experts, *shape), and any chunking
is allowed, which is what lets megatron load it at any TP/PP/EP.

We cannot use `dist_checkpointing.save` for conversion: it needs the whole sharded state dict in memory at
once. Instead a DCP save planner resolves every chunk lazily and the writer puts one layer per file, so a
conversion holds one layer. Reading goes straight to the chunks overlapping the requested layer.
"""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from rl_core.checkpoint_io import MANIFEST_FILE, verify_manifest

logger = logging.getLogger(__name__)

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Chunk:
    """One piece of the checkpoint: a tensor slice (dtype set) or a pickled object (dtype None)."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype | None
    group: int  # chunks of one group go to one file (one layer)


def checkpoint_key(mcore_name: str, num_layers: int, num_experts: int | None) -> tuple[str, tuple, tuple]:
    """(checkpoint key, prepended offsets, prepended global shape) of a canonical mcore name."""
    match = _LAYER_RE.match(mcore_name)
    if not match:
        return mcore_name, (), ()
    layer, rest = int(match.group(1)), match.group(2)
    expert = _EXPERT_RE.match(rest)
    if expert:
        return (f"decoder.layers.mlp.experts.experts.{expert.group(2)}", (layer, int(expert.group(1))),
                (num_layers, num_experts))
    return f"decoder.layers.{rest}", (layer,), (num_layers,)


def extra_state_chunk(key: str, prefix: tuple, prefix_shape: tuple, group: int) -> Chunk | None:
    """The `_extra_state` object megatron's local linear layers carry next to a linear weight."""
    if not key.endswith(".weight") or not re.search(r"linear_(qkv|proj|fc1|fc2)\.weight$", key) or not prefix:
        return None
    obj_key = key[: -len(".weight")] + "._extra_state"
    # megatron's ShardedObject.unique_key: key/shard_<offsets>_<global shape>, dot-joined.
    unique = f"{obj_key}/shard_{'.'.join(map(str, prefix))}_{'.'.join(map(str, prefix_shape))}"
    return Chunk(unique, (), (), (), None, group)


class _LazyPlanner(DefaultSavePlanner):
    """Plans the given chunks and produces each one's data only when the writer asks for it."""

    def __init__(self, chunks: list[Chunk], resolve: Callable[[Chunk], torch.Tensor | io.BytesIO]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = chunks
        self._resolve = resolve
        self._by_index: dict[MetadataIndex, Chunk] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for chunk in self._chunks:
            if chunk.dtype is None:
                index = MetadataIndex(chunk.key)
                items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            else:
                index = MetadataIndex(chunk.key, torch.Size(chunk.offsets))
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes)),
                    properties=TensorProperties(dtype=chunk.dtype), size=torch.Size(chunk.global_shape))))
            self._by_index[index] = chunk
        self.plan = SavePlan(items)
        return self.plan

    def group_of(self, item: WriteItem) -> int:
        return self._by_index[item.index].group

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        chunk = self._by_index[write_item.index]
        data = self._resolve(chunk)
        if chunk.dtype is not None and (tuple(data.shape) != chunk.sizes or data.dtype != chunk.dtype):
            raise ValueError(f"chunk {chunk.key}@{chunk.offsets}: produced {tuple(data.shape)} {data.dtype}, "
                             f"planned {chunk.sizes} {chunk.dtype}")
        return data


class _GroupedFileWriter(dcp.FileSystemWriter):
    """FileSystemWriter that writes one file per chunk group, in order, on the calling thread.

    The stock writer keeps every tensor of a file alive until the file is done, so files = layers bounds
    the memory to one layer."""

    def __init__(self, path: Path, planner: _LazyPlanner) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1, sync_files=False)
        self._planner = planner

    def write_data(self, plan: SavePlan, planner: object) -> object:
        import queue

        buckets: dict[int, list[WriteItem]] = {}
        for item in plan.items:
            buckets.setdefault(self._planner.group_of(item), []).append(item)
        files: queue.Queue = queue.Queue()
        for n, (_, items) in enumerate(sorted(buckets.items())):
            name = f"{plan.storage_data.prefix}{n}.distcp"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)


def write_checkpoint(out_dir: Path, chunks: list[Chunk],
                     resolve: Callable[[Chunk], torch.Tensor | io.BytesIO]) -> None:
    """Write a megatron torch_dist checkpoint into the existing, empty `out_dir`, chunk by chunk."""
    planner = _LazyPlanner(chunks, resolve)
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": single process on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=_GroupedFileWriter(out_dir, planner), planner=planner, no_dist=True)
    except CheckpointException as err:
        # DCP wraps errors per rank as (exception, traceback); surface ours (e.g. a ValueError naming a
        # tensor) instead of the wrapper.
        causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        if len(causes) == 1 and isinstance(causes[0], Exception):
            raise causes[0] from err
        raise
    torch.save({}, out_dir / "common.pt")  # megatron's non-sharded state: nothing for a GPTModel
    (out_dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


class CheckpointReader:
    """Reads layer slices of a torch_dist checkpoint (ours or one megatron saved at any TP/PP/EP)."""

    def __init__(self, ckpt_dir: str | Path) -> None:
        self.path = Path(ckpt_dir)
        if not (self.path / ".metadata").is_file():
            inner = next((d for d in sorted(self.path.glob("*/.metadata"))), None)  # a trainer's step_N/policy
            hint = f"; the checkpoint inside is {inner.parent}" if inner is not None else ""
            raise ValueError(f"{self.path} is not a megatron torch_dist checkpoint (no .metadata file){hint}")
        # torch's DCP reader unpickles `.metadata`: a checkpoint is code. One our engines wrote carries a
        # manifest (sizes, sha256) that is checked first; any other must come from a source you trust.
        if (self.path / MANIFEST_FILE).is_file():
            verify_manifest(self.path)
        else:
            logger.warning("%s has no %s to verify: reading its .metadata unpickles it, so convert only "
                           "checkpoints from a source you trust", self.path, MANIFEST_FILE)
        self.metadata = dcp.FileSystemReader(str(self.path)).read_metadata()

    def has(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor_md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_md(key).properties.dtype

    def _tensor_md(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"tensor {key!r} is missing from checkpoint {self.path}; is it a checkpoint of "
                             "the model described by its ckpt_convert.json?")
        return md

    def read(self, key: str, prefix: tuple[int, ...] = ()) -> torch.Tensor:
        """The tensor at `key[prefix]` (e.g. one layer of a stacked key), assembled from its chunks."""
        md = self._tensor_md(key)
        shape = tuple(md.size)
        lo = prefix + (0,) * (len(shape) - len(prefix))
        hi = tuple(p + 1 for p in prefix) + shape[len(prefix):]
        for chunk in md.chunks:  # one chunk is exactly the slice (our files): no assembly copy
            if tuple(chunk.offsets) == lo and tuple(chunk.sizes) == tuple(h - a for h, a in zip(hi, lo)):
                return self._load_chunk(key, chunk).reshape(shape[len(prefix):])
        out = torch.empty(shape[len(prefix):], dtype=md.properties.dtype)
        filled = 0
        for chunk in md.chunks:
            start = [max(a, b) for a, b in zip(lo, chunk.offsets)]
            stop = [min(a, b + s) for a, b, s in zip(hi, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(start, stop)):
                continue
            data = self._load_chunk(key, chunk)
            src = data[tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, chunk.offsets))]
            dst = out[tuple(slice(a - lo_, b - lo_) for a, b, lo_ in zip(start[len(prefix):], stop[len(prefix):],
                                                                           lo[len(prefix):]))]
            dst.copy_(src.reshape(dst.shape))
            filled += dst.numel()
        if filled != out.numel():
            raise ValueError(f"checkpoint {self.path}: chunks of {key!r} at {prefix} cover {filled} of "
                             f"{out.numel()} elements; the checkpoint is incomplete")
        return out

    def _load_chunk(self, key: str, chunk: ChunkStorageMetadata) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{key}: checkpoint chunks with transforms {info.transform_descriptors} "
                             "(compression/extensions) are not supported")
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def drop_absent_objects(sharded_state_dict: dict, ckpt_dir: str | Path) -> list[str]:
    """Remove the ShardedObjects (`_extra_state`) a checkpoint does not hold; return their keys.

    Our checkpoints carry the local spec's `_extra_state` objects; a Transformer Engine model asks for
    other ones (FP8 metadata of TE layers, TE attention), which must then start from their defaults."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    stored = CheckpointReader(ckpt_dir).metadata.state_dict_metadata
    dropped = [k for k, v in sharded_state_dict.items()
               if isinstance(v, ShardedObject) and v.unique_key not in stored]
    for key in dropped:
        del sharded_state_dict[key]
    return dropped


def load_into_model(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load a converted (or megatron-saved) checkpoint into a GPTModel of any spec and TP/PP/EP layout."""
    from megatron.core import dist_checkpointing

    sharded = model.sharded_state_dict()
    dropped = drop_absent_objects(sharded, ckpt_dir)
    if dropped:
        logger.info("%d _extra_state objects are not in %s; they keep their defaults", len(dropped), ckpt_dir)
    missing = model.load_state_dict(dist_checkpointing.load(sharded, str(ckpt_dir)), strict=False).missing_keys
    real = [k for k in missing if not k.endswith("_extra_state")]
    if real:
        raise ValueError(f"checkpoint {ckpt_dir} lacks {real[:5]}; it was written for another model config")
