"""Atomic writes, the checksum manifest, RNG state round trip, and loading without running pickle code."""

from __future__ import annotations

import random
import shutil
import types
from pathlib import Path

import pytest
import torch

from rl_core.checkpoint_io import (
    CheckpointError,
    DiskFullError,
    atomic_dir,
    atomic_write_text,
    changed_settings,
    load_tensors,
    rng_state,
    set_rng_state,
    verify_manifest,
    verify_manifest_on_all_ranks,
    write_manifest,
    write_manifest_on_all_ranks,
)
from rl_core.testing.distributed import run_distributed


class MarkerPayload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    torch.save({"rng": MarkerPayload(str(marker))}, tmp_path / "extra_rank0.pt")
    with pytest.raises(CheckpointError, match="extra_rank0.pt cannot be loaded safely"):
        load_tensors(tmp_path / "extra_rank0.pt")
    assert not marker.exists()


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    torch.manual_seed(3)
    random.seed(4)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(5), random.random())
    set_rng_state(load_tensors(tmp_path / "rng.pt"))
    assert torch.equal(torch.rand(5), want[0]) and random.random() == want[1]


def _run_checkpoint(root, engine_file: str, data: bytes) -> None:
    """A run checkpoint's layout: the engine's manifested `policy/` holding `engine_file`, a state file beside it."""
    (root / "policy").mkdir()
    (root / "policy" / engine_file).write_bytes(data)
    write_manifest(root / "policy")
    (root / "state.json").write_text("{}")
    write_manifest(root)


def test_manifest_names_the_damaged_file_and_covers_nested_manifests(tmp_path):
    _run_checkpoint(tmp_path, "shard.bin", b"abc" * 100)
    verify_manifest(tmp_path)
    (tmp_path / "policy/shard.bin").write_bytes(b"abd" * 100)  # same size, other bytes
    with pytest.raises(CheckpointError, match="shard.bin does not match its sha256"):
        verify_manifest(tmp_path)
    (tmp_path / "policy/shard.bin").write_bytes(b"ab")
    with pytest.raises(CheckpointError, match="shard.bin has 2 bytes"):
        verify_manifest(tmp_path)
    (tmp_path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="MANIFEST.json is missing"):
        verify_manifest(tmp_path)


def test_manifest_of_many_files_holds_each_files_sha256_and_finds_the_one_changed(tmp_path):
    """Each entry is hashlib's digest of that file (read in chunks), and one changed byte among many files is
    named."""
    import hashlib
    import json

    rng = random.Random(0)
    for i in range(12):
        (tmp_path / f"__{i}_0.distcp").write_bytes(rng.randbytes(rng.randrange(1, 3 << 20)))
    write_manifest(tmp_path)
    files = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]
    assert files == {f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                     for f in tmp_path.glob("*.distcp")}
    verify_manifest(tmp_path)
    changed = tmp_path / "__7_0.distcp"
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 1
    changed.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__7_0.distcp does not match its sha256"):
        verify_manifest(tmp_path)


def test_sizes_only_under_a_subdirectory_leaves_its_bytes_to_its_loader_but_not_its_sizes_or_manifest(tmp_path):
    _run_checkpoint(tmp_path, "weights.bin", b"w" * 100)
    (tmp_path / "policy/weights.bin").write_bytes(b"x" + b"w" * 99)  # same size: the loader's to find
    verify_manifest(tmp_path, sizes_only_under=("policy",))
    with pytest.raises(CheckpointError, match="weights.bin does not match its sha256"):
        verify_manifest(tmp_path)
    (tmp_path / "policy/weights.bin").write_bytes(b"w" * 99)
    with pytest.raises(CheckpointError, match="weights.bin has 99 bytes, the manifest says 100"):
        verify_manifest(tmp_path, sizes_only_under=("policy",))
    (tmp_path / "policy/weights.bin").write_bytes(b"w" * 100)
    (tmp_path / "state.json").write_text("[]")  # outside the subdirectory: hashed
    with pytest.raises(CheckpointError, match="state.json does not match its sha256"):
        verify_manifest(tmp_path, sizes_only_under=("policy",))


def _hash_on_all_ranks(rank: int, world: int, directory: str) -> dict:
    """Each rank's hashed bytes while writing and verifying the manifest together, and the error each raises once
    the largest file (hashed by one rank only) has one byte changed."""
    import torch.distributed as dist

    import rl_core.checkpoint_io as checkpoint_io

    hashed, sha256 = [], checkpoint_io._sha256
    checkpoint_io._sha256 = lambda path: hashed.append(path.stat().st_size) or sha256(path)
    write_manifest_on_all_ranks(directory)
    written = sum(hashed)
    verify_manifest_on_all_ranks(directory)
    verified = sum(hashed) - written
    if rank == 0:
        largest = max(Path(directory).glob("*.bin"), key=lambda f: f.stat().st_size)
        data = bytearray(largest.read_bytes())
        data[-1] ^= 1
        largest.write_bytes(bytes(data))
    dist.barrier()
    try:
        verify_manifest_on_all_ranks(directory)
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"written": written, "verified": verified, "error": error}


def test_ranks_share_the_hashing_and_agree(tmp_path):
    """Two ranks write the manifest one process writes, each hashing about half the bytes (largest file first to
    the least loaded rank); a change in a file only rank 0 or 1 hashed is an error on both ranks alike."""
    import hashlib
    import json

    sizes = [5 << 20, 4 << 20, 3 << 20, 2 << 20, 1 << 20, 100]
    rng = random.Random(1)
    for i, size in enumerate(sizes):
        (tmp_path / f"shard{i}.bin").write_bytes(rng.randbytes(size))
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested/state.json").write_text("{}")
    write_manifest(tmp_path / "nested")
    results = run_distributed(_hash_on_all_ranks, 2, args=(str(tmp_path),))
    listed = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]
    assert listed.keys() == {*(f"shard{i}.bin" for i in range(6)), "nested/MANIFEST.json"}
    for name, entry in listed.items():  # hashlib's digest of the file as written (before the change below)
        if name != "shard0.bin":
            assert entry["sha256"] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
    total = sum(sizes) + (tmp_path / "nested/MANIFEST.json").stat().st_size
    half = (8 << 20) + 4096  # the best split of these sizes (5+2+1 | 4+3 MiB) and the small files
    assert sum(r["written"] for r in results) == total and max(r["written"] for r in results) <= half
    assert all(0 < r["verified"] <= half for r in results)
    assert results[0]["error"] == results[1]["error"] and "shard0.bin does not match its sha256" in results[0]["error"]


def test_atomic_dir_publishes_whole_or_nothing(tmp_path):
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed")
    assert (tmp_path / "out/a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    atomic_write_text(tmp_path / "f.txt", "x")
    assert (tmp_path / "f.txt").read_text() == "x" and len(list(tmp_path.iterdir())) == 2


def test_a_write_that_fills_the_disk_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    (seen on a 3 MiB tmpfs), which names no disk. The filesystem is read while the partial files still fill it:
    removed first, their space would look free."""
    def disk_usage(path):  # full while the partial write holds the space, as a real filesystem would be
        partial = any(p.is_file() for p in tmp_path.glob(".step_3.tmp-*/**/*"))
        return types.SimpleNamespace(total=2**30, free=4096 if partial else 2**29)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with pytest.raises(DiskFullError, match=rf"no space left on the filesystem of {tmp_path} \(0.0 MiB free of 1.0 GiB\) "
                                            r"while step_3 was written \(RuntimeError\)") as caught:
        with atomic_dir(tmp_path / "step_3") as tmp:
            (tmp / "model.pt").write_bytes(b"partial")
            raise torch_error
    assert caught.value.__cause__ is torch_error and list(tmp_path.iterdir()) == []
    with pytest.raises(DiskFullError, match="while inner was written") as nested:  # said once, by the inner one
        with atomic_dir(tmp_path / "step_3") as outer:
            (outer / "state.json").write_text("{}")  # still filling the disk once the inner one removed its files
            with atomic_dir(outer / "inner") as inner:
                (inner / "model.pt").write_bytes(b"partial")
                raise torch_error
    assert "step_3 was written" not in str(nested.value)
    assert nested.value.__cause__ is torch_error and list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="unexpected pos"), atomic_dir(tmp_path / "step_3"):
        raise torch_error  # nothing written, room left: not the disk, the error as it was
    assert list(tmp_path.iterdir()) == []


def test_changed_settings_names_each_optimizer_setting_a_resume_changes():
    configured = [{"base_lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-8}, {"base_lr": 0.01, "betas": (0.8, 0.9)}]
    saved = [{"base_lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8}, {"base_lr": 0.001, "betas": (0.9, 0.999)}]
    assert changed_settings(configured, saved) == ["base_lr 0.001 -> 0.01", "betas (0.9, 0.999) -> (0.8, 0.9)"]
    assert changed_settings(configured, configured) == []


def test_atomic_writes_get_the_modes_of_plain_writes(tmp_path):
    """A published directory and the files in it are readable as mkdir / open() under the umask would make them
    (mkdtemp's 0700, mkstemp's 0600 and safetensors' 0600 hid exported models and manifests from other users)."""
    import os
    import stat

    from safetensors.torch import save_file

    previous = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            atomic_write_text(tmp / "config.json", "{}")
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        os.mkdir(tmp_path / "plain_dir")
        (tmp_path / "plain_file").write_text("{}")
    finally:
        os.umask(previous)

    def mode(path):
        return stat.S_IMODE(os.stat(path).st_mode)

    assert mode(tmp_path / "model") == mode(tmp_path / "plain_dir") == 0o755
    assert mode(tmp_path / "model/config.json") == mode(tmp_path / "plain_file") == 0o644
    assert mode(tmp_path / "model/model.safetensors") == 0o644
