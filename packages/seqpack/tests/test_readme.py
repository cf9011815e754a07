"""The README's example runs as written, and its round trip gives back every sequence in input order."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_round_trips():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, "the README has one python example"
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)  # noqa: S102 - our own README
    seqs, per_sequence = scope["seqs"], scope["per_sequence"]
    assert len(per_sequence) == len(seqs)
    assert all(torch.equal(a, b) for a, b in zip(per_sequence, seqs))
    # the last micro-batch's CP shard is half its row (cp_size=2) and its mask is (T, T)
    assert scope["local"].shape[0] * 2 == scope["layout"].total_len
    assert scope["mask"].shape == (scope["layout"].total_len,) * 2
