"""Run checkpoints: engine state plus the trainer's own state, written atomically, keep-top-k.

A checkpoint is `<dir>/step_<N>/` holding `policy/` (written by the engines) and `trainer_state.json`
(step, data position, RNG, metric history). It is assembled under `.step_<N>.tmp` and renamed when
complete, so a killed run leaves either a whole checkpoint or none. Pruning keeps the `keep_top_k` best
by the configured metric, and always the latest (the one a restart resumes from).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


class CheckpointManager:
    def __init__(self, root: Path, *, keep_top_k: int, metric: str, higher_is_better: bool) -> None:
        self.root, self.keep_top_k, self.metric, self.higher_is_better = Path(root), keep_top_k, metric, higher_is_better

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name.split("_")[1]) for p in self.root.glob("step_*") if (p / STATE_FILE).is_file())

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def save(self, step: int, save_engine: Any, state: dict[str, Any]) -> Path:
        """`save_engine(path)` writes the policy; `state` is the trainer's JSON-serialisable state."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".step_{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_engine(str(tmp / "policy"))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        logger.info("checkpoint saved: %s", final)
        self._prune()
        return final

    def load_state(self, path: Path) -> dict[str, Any]:
        return json.loads((path / STATE_FILE).read_text())

    def _score(self, step: int) -> float | None:
        state = self.load_state(self.root / f"step_{step}")
        value = state.get("checkpoint_metric")
        return None if value is None else (value if self.higher_is_better else -value)

    def _prune(self) -> None:
        steps = self.steps()
        if len(steps) <= self.keep_top_k:
            return
        scored = sorted(steps, key=lambda s: (self._score(s) is not None, self._score(s) or 0.0, s), reverse=True)
        keep = set(scored[: self.keep_top_k]) | {steps[-1]}
        for step in steps:
            if step not in keep:
                shutil.rmtree(self.root / f"step_{step}", ignore_errors=True)
                logger.info("checkpoint pruned: step_%d (%s)", step, self.metric)
