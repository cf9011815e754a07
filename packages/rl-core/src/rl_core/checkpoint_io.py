"""Crash-safe checkpoint files: atomic writes, a checksum manifest, RNG state, loading without pickle code.

- `atomic_write_text` / `atomic_dir` / `publish_dir`: write beside the target, fsync, then rename, so a
  reader (or a restarted run) sees the old version or the new one, never a half-written one.
- `write_manifest` / `verify_manifest`: `MANIFEST.json`, written last, lists the relative path, size and
  sha256 of every file under a directory. A subdirectory with its own manifest is covered by that
  manifest's checksum (verified recursively), so an engine checkpoint inside a run checkpoint is hashed
  once. `*_on_all_ranks`: every rank of a process group hashes a share of the files. Verifying before loading is what keeps a damaged file from being read, and what protects
  torch's DCP reader, which unpickles `.metadata`: a checkpoint from elsewhere is code, trust it as such.
- `DiskFullError`: what an `atomic_dir` write that ran out of space raises (torch's own error hides it).
- `recover_publish`: after a crash inside a replacing `publish_dir`, the previous version back in place.
- `rng_state` / `set_rng_state`: torch (CPU, CUDA) and Python RNG as tensors and plain types.
- `changed_settings`: what a resumed run's optimizer config changes from its checkpoint's (for the log).
- `load_tensors`: `torch.load(weights_only=True)`: tensors, containers and numbers only; a file that
  asks to run code is refused with `CheckpointError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MANIFEST_FILE = "MANIFEST.json"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged or unsafe to load; the message names the file."""


class DiskFullError(OSError):
    """An `atomic_dir` write failed with its filesystem full. torch hides the ENOSPC of its writers (torch.save:
    "[enforce fail at inline_container.cc] unexpected pos 704 vs 598"), so the free space is what tells."""


def _filesystem_full(path: str | os.PathLike) -> str | None:
    """'<free> free of <total>' where the filesystem of `path` has (almost) no room left, else None: less free
    than 1% of it, capped at 64 MiB (a write that ran out of space has filled it to the last blocks)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:  # gone, or unreadable: nothing to tell, and the error being handled stays the one raised
        return None
    if usage.free >= min(64 * 2**20, usage.total // 100):
        return None
    return f"{format_bytes(usage.free)} free of {format_bytes(usage.total)}"


def format_bytes(n: float) -> str:
    """`n` bytes in GiB, or in MiB below 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """This process's umask, read without changing it (os.umask sets one to read it, a race with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a synced temporary sibling and a rename; the file gets the mode a plain
    open() would give (mkstemp's is 0600: a manifest or config another user could not read)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, and give each the mode a plain open() would (safetensors >= 0.8 writes its
    files 0600: model weights that a vLLM server run by another user could not read)."""
    file_mode = 0o666 & ~umask()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        os.chmod(file, file_mode)
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike, *, replace: bool = True) -> None:
    """Make the complete directory `tmp` appear as `final` (replacing an existing one) after syncing it.

    An existing `final` is moved aside first and removed after the rename, so a crash in between leaves
    `final.old` and `tmp` (both ignored by readers), never a mix of the two versions; `recover_publish`
    puts `final.old` back. `replace=False`: an
    existing `final` (one that appeared since the caller checked) is FileExistsError, left as it is.
    """
    tmp, final = Path(tmp), Path(final)
    if not replace and final.exists():
        raise FileExistsError(f"{final} appeared while it was being written; it was left alone (nothing written)")
    _fsync_tree(tmp)
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def recover_publish(final: str | os.PathLike) -> None:
    """Finish a `publish_dir` that a crash cut short. `final.old` beside `final`: the crash came after the
    new version's rename, and the old one goes. `final.old` alone: the crash came between the two renames,
    and `final.old` is the previous version: it becomes `final` again if it verifies against its manifest
    (the new one, under its temporary name, was never published); anything else is left alone."""
    final = Path(final)
    old = final.with_name(final.name + ".old")
    if not old.is_dir():
        return
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        verify_manifest(old)
    except CheckpointError:
        return
    os.rename(old, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """A fresh temporary sibling of `final` to fill; published as `final` on success (`replace`: see
    `publish_dir`), removed on error: `DiskFullError` (the original error its cause) where the filesystem was full
    as it failed. It gets the mode a plain mkdir would give (mkdtemp's is 0700: an exported model that a vLLM server
    run by another user could not read)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    os.chmod(tmp, 0o777 & ~umask())
    try:
        yield tmp
        publish_dir(tmp, final, replace=replace)
    except Exception as exc:
        full = _filesystem_full(final.parent)  # before the partial files go, or the space they hold looks free
        if full is None or isinstance(exc, DiskFullError):  # a nested atomic_dir's has said it already
            raise
        raise DiskFullError(f"no space left on the filesystem of {final.parent} ({full}) while {final.name} was "
                            f"written ({type(exc).__name__}): nothing was published, and the partial files are "
                            "removed") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_shared(files: list[Path], collective: bool) -> list[str]:
    """sha256 of each file. `collective`: every rank of the default process group calls it with the same list and
    gets all digests, the files shared out by size (a checkpoint is hashed on the critical path of every save and
    resume, and n ranks, n nodes' disks, read it n times faster than one); a file that cannot be read gets a
    digest that matches nothing, not an exception that would leave the other ranks waiting in the collective."""
    if not collective or dist.get_world_size() == 1:
        return [_readable_sha256(file) for file in files]
    rank, world = dist.get_rank(), dist.get_world_size()
    owner = _owners([_size(file) for file in files], world)
    mine = {i: _readable_sha256(file) for i, file in enumerate(files) if owner[i] == rank}
    gathered: list[dict[int, str]] = [{} for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    digests = {i: digest for part in gathered for i, digest in part.items()}
    return [digests[i] for i in range(len(files))]


def _owners(sizes: list[int], world: int) -> list[int]:
    """The rank that hashes each file: the largest first, each to the rank with the fewest bytes so far."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(world), key=load.__getitem__)
        load[owner[i]] += sizes[i]
    return owner


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:
        return 0


def _readable_sha256(file: Path) -> str:
    try:
        return _sha256(file)
    except OSError as exc:
        return f"unreadable: {exc}"


def _manifest_files(root: Path, directory: Path) -> list[Path]:
    """What a manifest of `root` lists: every file below it, a subdirectory with a manifest of its own by that
    manifest alone (so an engine checkpoint inside a run checkpoint is hashed once)."""
    files = []
    for item in sorted(directory.iterdir()):
        if item.is_dir() and (item / MANIFEST_FILE).is_file():
            item = item / MANIFEST_FILE
        elif item.is_dir():
            files += _manifest_files(root, item)
            continue
        if item.is_file() and item != root / MANIFEST_FILE:
            files.append(item)
    return files


def write_manifest(directory: str | os.PathLike) -> Path:
    """Write `directory/MANIFEST.json` (size and sha256 of every file); call it after the last file."""
    return _write_manifest(Path(directory), collective=False)


def write_manifest_on_all_ranks(directory: str | os.PathLike) -> Path:
    """`write_manifest` by every rank of the default process group together: each hashes a share of the files,
    rank 0 writes (one process alone outside a group)."""
    return _write_manifest(Path(directory), collective=dist.is_initialized())


def verify_manifest(directory: str | os.PathLike, *, sizes_only_under: tuple[str, ...] = ()) -> None:
    """Check every file against `directory/MANIFEST.json` (and nested manifests); raise CheckpointError naming the
    first damaged file. The files below the subdirectories `sizes_only_under` are checked for presence and size
    only (their nested manifest is still hashed): for a reader whose loader hashes them anyway, on all its ranks."""
    _verify_manifest(Path(directory), collective=False, sizes_only_under=sizes_only_under)


def verify_manifest_on_all_ranks(directory: str | os.PathLike) -> None:
    """`verify_manifest` by every rank of the default process group together: rank 0 reads the manifests, each
    rank hashes a share of the files, every rank raises the same error (one process alone outside a group)."""
    _verify_manifest(Path(directory), collective=dist.is_initialized())


def _write_manifest(directory: Path, collective: bool) -> Path:
    rank0 = not collective or dist.get_rank() == 0
    box = [_manifest_files(directory, directory) if rank0 else None]
    if collective:
        dist.broadcast_object_list(box, src=0)
    files = box[0]
    digests = _sha256_shared(files, collective)
    path = directory / MANIFEST_FILE
    if rank0:
        entries = {file.relative_to(directory).as_posix(): {"size": file.stat().st_size, "sha256": digest}
                   for file, digest in zip(files, digests)}
        atomic_write_text(path, json.dumps({"files": entries}, indent=1))
    return path


def _verify_manifest(directory: Path, collective: bool, sizes_only_under: tuple[str, ...] = ()) -> None:
    box: list[Any] = [None, []]
    if not collective or dist.get_rank() == 0:
        try:
            skipped = [directory / sub for sub in sizes_only_under]
            box[1] = [item for item in _listed_files(directory)
                      if not any(item[0].is_relative_to(sub) for sub in skipped)]
        except CheckpointError as exc:  # a missing manifest or file, a wrong size: no hashing needed
            box[0] = str(exc)
    if collective:
        dist.broadcast_object_list(box, src=0)
    problem, listed = box
    if problem is not None:
        raise CheckpointError(problem)
    digests = _sha256_shared([file for file, _, _ in listed], collective)
    for (file, expected, manifest), digest in zip(listed, digests):
        if digest != expected:
            raise CheckpointError(f"{file} does not match its sha256 in {manifest}: the file was changed")


def _listed_files(directory: Path) -> list[tuple[Path, str, Path]]:
    """(file, sha256, manifest) of every file `directory/MANIFEST.json` lists, nested manifests' files instead of
    those manifests once their own digest matched (their lists are trusted only then); raises CheckpointError for
    a missing or invalid manifest, a missing file or a wrong size."""
    path = directory / MANIFEST_FILE
    try:
        files = json.loads(path.read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint was not completely written") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid manifest ({exc})") from None
    listed = []
    for rel, expected in files.items():
        file = directory / rel
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {path})")
        if file.stat().st_size != expected["size"]:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest says {expected['size']}")
        if file.name != MANIFEST_FILE:
            listed.append((file, expected["sha256"], path))
        elif _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file} does not match its sha256 in {path}: the file was changed")
        else:
            listed += _listed_files(file.parent)
    return listed


def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA) and Python RNG state, as tensors and plain types."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA only where it was saved and is available)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def changed_settings(configured: list[dict[str, Any]], saved: list[dict[str, Any]]) -> list[str]:
    """`key saved -> configured` for each setting of each optimizer param group that a checkpoint has otherwise."""
    return sorted({f"{key} {old!r} -> {new.get(key)!r}" for new, old_group in zip(configured, saved)
                   for key, old in old_group.items() if new.get(key) != old})


def load_tensors(path: str | os.PathLike) -> Any:
    """`torch.load` that never runs code from the file (weights_only): tensors and plain types only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # pickle.UnpicklingError for code, RuntimeError for a truncated zip
        raise CheckpointError(f"{path} cannot be loaded safely (it holds something other than tensors and "
                              f"plain values, or is damaged): {str(exc).splitlines()[0]}") from None
