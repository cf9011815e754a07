"""One sink for every metric: JSONL, TensorBoard, the progress bar, the final plot and summary.

Keys are namespaced (`train/loss`, `rollout/reward_mean`, `val/reward_mean`, `timing/generate_s`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PHASES = ("generate", "reward", "logprobs", "train", "refit")


class MetricsSink:
    def __init__(self, log_dir: Path, *, tensorboard: bool, resume: bool) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if resume and self.jsonl_path.exists():
            self.history = [json.loads(line) for line in self.jsonl_path.read_text().splitlines() if line]
        elif self.jsonl_path.exists():
            self.jsonl_path.unlink()
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir / "tensorboard"))

    def truncate(self, last_step: int) -> None:
        """Forget records after `last_step` (a resumed run repeats them)."""
        self.history = [r for r in self.history if r["step"] <= last_step]
        self.jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in self.history))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)
            self.writer.flush()

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.history if key in r]
        return [p[0] for p in points], [p[1] for p in points]

    def plot(self, path: Path) -> Path:
        """PNG: train and validation reward over steps, and the stacked per-phase step time."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_reward, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
        for key, label in (("rollout/reward_mean", "train reward"), ("val/reward_mean", "validation reward")):
            steps, values = self.series(key)
            ax_reward.plot(steps, values, marker="o" if key.startswith("val") else None, label=label)
        ax_reward.set(xlabel="step", ylabel="reward", title="Reward")
        ax_reward.legend()
        bottom = None
        for phase in PHASES:
            steps, values = self.series(f"timing/{phase}_s")
            if not steps:
                continue
            ax_time.bar(steps, values, bottom=bottom, label=phase)
            bottom = values if bottom is None else [a + b for a, b in zip(bottom, values)]
        ax_time.set(xlabel="step", ylabel="seconds", title="Step time by phase")
        ax_time.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def summary(self) -> str:
        """Validation reward before/after and the mean time per phase, as a text table."""
        _, val = self.series("val/reward_mean")
        lines = []
        if val:
            lines.append(f"validation reward: {val[0]:.3f} -> {val[-1]:.3f} ({val[-1] - val[0]:+.3f})")
        lines.append(f"{'phase':<10} {'mean s/step':>12} {'share':>7}")
        means = {}
        for phase in PHASES:
            _, values = self.series(f"timing/{phase}_s")
            if values:
                means[phase] = sum(values) / len(values)
        total = sum(means.values()) or 1.0
        for phase, mean in means.items():
            lines.append(f"{phase:<10} {mean:>12.3f} {mean / total:>6.1%}")
        lines.append(f"{'total':<10} {total:>12.3f}")
        return "\n".join(lines)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
