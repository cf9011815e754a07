"""One sink for every metric: JSONL, TensorBoard, the progress bar, the final plot and summary.

Keys are namespaced (`train/loss`, `rollout/reward_mean`, `val/reward_mean`, `timing/generate_s`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from rl_core.checkpoint_io import atomic_write_text

logger = logging.getLogger(__name__)

# rollout_wait: grpo.async_rollouts only; a step's generation and scoring, where its groups were sampled ahead
# (`rollout/sampled_ahead`), ran beside the previous step and are not part of its time
PHASES = ("generate", "reward", "rollout_wait", "logprobs", "train", "refit")
SAMPLING = ("generate", "reward")


# what the log line of a step shows where no progress bar does (logger.progress_bar=false), as it is keyed in
# metrics.jsonl and TensorBoard
STEP_LOG_KEYS = ("rollout/reward_mean", "val/reward_mean", "val/accuracy", "train/loss", "train/grad_norm",
                 "timing/step_s")


def format_metrics(metrics: dict[str, float], keys: tuple[str, ...] | None = None) -> str:
    """`key=value` for `keys` (default: all) that `metrics` has, with 4 significant digits."""
    return " ".join(f"{k}={metrics[k]:.4g}" for k in (keys if keys is not None else metrics) if k in metrics)


class MetricsSink:
    """`resume_step`: the step a resumed run continues from (None: a new run).

    On resume, records from `resume_step` on are dropped from metrics.jsonl (the run repeats them) and
    TensorBoard purges its events from that step (a new event file whose first event is a restart at
    `resume_step`; readers hide the older events at or after it), so no step is shown twice. Records
    are strict JSON: a NaN or infinite value is written as null.
    """

    def __init__(self, log_dir: Path, *, tensorboard: bool, resume_step: int | None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if resume_step is not None and self.jsonl_path.exists():
            self.history = [r for r in read_jsonl(self.jsonl_path) if r["step"] < resume_step]
        elif self.jsonl_path.exists():
            logger.warning("%s is from a run without a checkpoint to resume from: starting it again",
                           self.jsonl_path)
        atomic_write_text(self.jsonl_path, "".join(_json_line(r) for r in self.history))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=resume_step or 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.jsonl_path.open("a") as f:
            f.write(_json_line(record))
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)
            self.writer.flush()

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
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
        steps, per_step = self._phase_times()
        bottom = [0.0] * len(steps)
        for phase in PHASES:
            values = [times.get(phase, 0.0) for times in per_step]  # a phase a step did not have stacks as 0
            if any(values):
                ax_time.bar(steps, values, bottom=bottom, label=phase)
                bottom = [a + b for a, b in zip(bottom, values)]
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
        lines.append(f"{'phase':<12} {'mean s/step':>12} {'share':>7}")
        steps, per_step = self._phase_times()
        means = {phase: sum(t.get(phase, 0.0) for t in per_step) / len(steps) for phase in PHASES
                 if any(phase in t for t in per_step)}
        total = sum(means.values()) or 1.0
        for phase, mean in means.items():
            lines.append(f"{phase:<12} {mean:>12.3f} {mean / total:>6.1%}")
        lines.append(f"{'total':<12} {total:>12.3f}")
        ahead = [r for r in self.history if r.get("rollout/sampled_ahead")]
        if ahead:
            for phase in SAMPLING:
                mean = sum(r.get(f"timing/{phase}_s") or 0.0 for r in ahead) / len(ahead)
                lines.append(f"{phase + ' *':<12} {mean:>12.3f}")
            lines.append(f"* of the {len(ahead)} steps whose groups were sampled beside the previous step's training "
                         "(grpo.async_rollouts)")
        return "\n".join(lines)

    def _phase_times(self) -> tuple[list[int], list[dict[str, float]]]:
        """The steps, and the seconds of each phase a step spent itself (not what ran beside the step before)."""
        steps, per_step = [], []
        for record in self.history:
            if record.get("timing/step_s") is None:
                continue
            beside = SAMPLING if record.get("rollout/sampled_ahead") else ()
            steps.append(record["step"])
            per_step.append({phase: record[f"timing/{phase}_s"] for phase in PHASES
                             if phase not in beside and record.get(f"timing/{phase}_s") is not None})
        return steps, per_step

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, allow_nan=False) + "\n"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a write cut by a kill) is dropped with a warning."""
    lines = path.read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            if number == len(lines):  # no newline after it: the last write did not finish
                logger.warning("%s:%d is an incomplete record (the run was killed while writing it); dropped",
                               path, number)
                continue
            raise ValueError(f"{path}:{number} is not a JSON record ({exc}); fix or delete that line") from None
    return records
