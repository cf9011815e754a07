"""Every file path the documentation names exists (a renamed config or script leaves no dead command behind)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a repository path such as apps/grpo/grpo_app/configs/gpu_1x.yaml or scripts/test.sh, not part of a longer path or URL
PATH = re.compile(r"(?<![\w./-])((?:apps|packages|bench|scripts|tests|\.ci)/[\w./-]+\.(?:yaml|py|sh|md|toml))")


def _docs() -> list[Path]:
    docs = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "runs"]  # venvs, .git, outputs
        docs += [Path(folder) / f for f in files if f.endswith(".md")]
    return docs


def test_paths_named_in_docs_exist() -> None:
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in _docs() for path in PATH.findall(doc.read_text())
               if not (ROOT / path).exists() and not (doc.parent / path).exists()]
    assert len(_docs()) > 5
    assert not missing, "documentation names files that do not exist:\n" + "\n".join(missing)
