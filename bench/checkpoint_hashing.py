"""Checkpoint manifests: one process hashing every file vs the ranks of the process group sharing the files.

    uv run bench/checkpoint_hashing.py [--files 8] [--mib 256] [--ranks 2] [--repeats 3]

Every save and every resume hashes the whole checkpoint (sha256 of each file in MANIFEST.json), on the critical
path: the other ranks wait at a barrier. `write_manifest` / `verify_manifest` hash in one process;
`write_manifest_on_all_ranks` / `verify_manifest_on_all_ranks` (what the engines call) share the files out by size
over the ranks (gloo here, one process per rank as under torchrun). The files are random bytes in a temporary
directory (the page cache holds them: this measures hashing, not the disk). Times are the median of --repeats,
each side measured in the same run.

The second table is a resume as the trainer runs it: the driver checks the run checkpoint (`step_N/`, the engine's
files under `policy/`) before Ray starts, then the engine verifies `policy/` on all its ranks as it loads it. The
driver used to hash `policy/` too (one process); it now checks its files' sizes only (`sizes_only_under`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import markdown_table

from rl_core.checkpoint_io import (
    verify_manifest,
    verify_manifest_on_all_ranks,
    write_manifest,
    write_manifest_on_all_ranks,
)
from rl_core.testing.distributed import run_distributed


def _timed(fn, directory: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(directory)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _on_all_ranks(rank: int, world: int, directory: str, repeats: int) -> tuple[float, float]:
    return (_timed(write_manifest_on_all_ranks, directory, repeats),
            _timed(verify_manifest_on_all_ranks, directory, repeats))


def _resume_table(checkpoint: Path, args: argparse.Namespace, engine_s: float) -> list[list[str]]:
    """A resume's hashing: the driver's check of the run checkpoint, then the engine's of policy/ (`engine_s`)."""
    hashed = _timed(verify_manifest, str(checkpoint), args.repeats)
    sizes = _timed(lambda d: verify_manifest(d, sizes_only_under=("policy",)), str(checkpoint), args.repeats)
    return [["driver hashes policy/ too (before)", f"{hashed:.2f}", f"{engine_s:.2f}", f"{hashed + engine_s:.2f}",
             "1.00x"],
            ["driver checks policy/'s sizes (now)", f"{sizes:.3f}", f"{engine_s:.2f}", f"{sizes + engine_s:.2f}",
             f"{(hashed + engine_s) / (sizes + engine_s):.2f}x"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8, help="files in the checkpoint (DCP writes one per rank)")
    parser.add_argument("--mib", type=int, default=256, help="MiB per file")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        checkpoint = Path(root) / "step_1"
        directory = str(checkpoint / "policy")  # the engine's checkpoint inside the run's
        Path(directory).mkdir(parents=True)
        for i in range(args.files):
            Path(directory, f"__{i}_0.distcp").write_bytes(os.urandom(args.mib << 20))
        verify_manifest(write_manifest(directory).parent)  # warm the page cache
        one = (_timed(write_manifest, directory, args.repeats), _timed(verify_manifest, directory, args.repeats))
        shared = run_distributed(_on_all_ranks, args.ranks, args=(directory, args.repeats), timeout=3600)[0]
        write_manifest(directory)
        (checkpoint / "trainer_state.json").write_text('{"step": 1}')
        write_manifest(checkpoint)
        resume = _resume_table(checkpoint, args, shared[1])
    gib = args.files * args.mib / 1024
    rows = [["1 process", f"{one[0]:.2f}", f"{one[1]:.2f}", f"{gib / one[1]:.2f}", "1.00x"],
            [f"{args.ranks} ranks", f"{shared[0]:.2f}", f"{shared[1]:.2f}", f"{gib / shared[1]:.2f}",
             f"{one[1] / shared[1]:.2f}x"]]
    print(f"{args.files} files x {args.mib} MiB ({gib:.1f} GiB), median of {args.repeats}, {os.cpu_count()} CPUs")
    print(markdown_table(["hashing", "write manifest s", "verify s", "verify GiB/s", "verify speed-up"], rows))
    print(f"\nresume (engine on {args.ranks} ranks)")
    print(markdown_table(["driver", "driver s", "engine s", "total s", "speed-up"], resume))


if __name__ == "__main__":
    main()
