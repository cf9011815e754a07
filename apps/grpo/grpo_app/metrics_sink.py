"""One sink for every metric: JSONL, TensorBoard, Weights & Biases, the final plot and summary.

Keys are namespaced (`train/loss`, `rollout/reward_mean`, `val/reward_mean`, `timing/generate_s`).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from grpo_app.config import WandbConfig
from rl_core.checkpoint_io import atomic_write_text
from rl_core.config import ConfigError

logger = logging.getLogger(__name__)

# rollout_wait: grpo.async_rollouts only; a step's generation and scoring, where its groups were sampled ahead
# (`rollout/sampled_ahead`), ran beside the previous step and are not part of its time
PHASES = ("generate", "reward", "rollout_wait", "logprobs", "train", "refit")
SAMPLING = ("generate", "reward")
# timed by the loop around the step, not part of timing/step_s, on the steps that have them: a validation goes with
# the record of its val/* metrics (the last one's has no step of its own), a checkpoint with the step it saves
OUTSIDE_STEP = ("val", "checkpoint")
WANDB_RUN_ID_FILE = "wandb_run_id"  # in the log dir: the W&B run a resumed run continues


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
    `resume_step`; readers hide the older events at or after it), and the W&B run (`start_wandb`) is
    rewound to the step before, so no step is shown twice. Records are strict JSON: a NaN or infinite
    value is written as null.
    """

    def __init__(self, log_dir: Path, *, tensorboard: bool, resume_step: int | None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self.resume_step = resume_step
        self.history: list[dict[str, Any]] = []
        self.last_dropped_step: int | None = None  # the last step logged before that the resumed run repeats
        self.wandb_run: Any = None  # a wandb Run once start_wandb ran
        if resume_step is not None and self.jsonl_path.exists():
            logged = read_jsonl(self.jsonl_path)
            self.history = [r for r in logged if r["step"] < resume_step]
            self.last_dropped_step = max((r["step"] for r in logged if r["step"] >= resume_step), default=None)
        elif self.jsonl_path.exists():
            logger.warning("%s is from a run without a checkpoint to resume from: starting it again",
                           self.jsonl_path)
        atomic_write_text(self.jsonl_path, "".join(_json_line(r) for r in self.history))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir / "tensorboard"), purge_step=resume_step or 0)

    def start_wandb(self, cfg: WandbConfig, run_config: dict[str, Any]) -> None:
        """From now on every record goes to a W&B run too (nothing where logger.wandb.enabled is false), with the
        resolved config. The run's id is kept in <log_dir>/wandb_run_id, so a resumed run continues its W&B run."""
        if not cfg.enabled:
            return
        import wandb

        settings = dict(project=cfg.project, name=cfg.name or self.log_dir.name, entity=cfg.entity, tags=cfg.tags,
                        mode=cfg.mode, dir=str(self.log_dir), config=run_config)
        id_path = self.log_dir / WANDB_RUN_ID_FILE
        resumes = bool(self.resume_step) and id_path.exists()
        if cfg.mode not in ("offline", "disabled"):  # wandb says only "setting up run" while it retries a server
            logger.info("starting the W&B run: a server it cannot reach fails after wandb's init_timeout (90 s, "
                        "WANDB_INIT_TIMEOUT); logger.wandb.mode=offline needs none")
        try:
            self.wandb_run = (self._continue_wandb(id_path.read_text().strip(), settings) if resumes
                              else wandb.init(**settings))
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:  # not logged in, above all
            raise ConfigError(f"logger.wandb: W&B did not start the run: {exc} (or WANDB_API_KEY); or set "
                              "logger.wandb.mode=offline (upload later with `wandb sync`), or "
                              "logger.wandb.enabled=false") from None
        except wandb.errors.CommError as exc:  # no network: its message goes on about init_timeout, keep line one
            raise ConfigError(f"logger.wandb: W&B could not reach its server: {str(exc).splitlines()[0]}; set "
                              "logger.wandb.mode=offline (upload later with `wandb sync`), or "
                              "logger.wandb.enabled=false") from None
        if not resumes:
            atomic_write_text(id_path, self.wandb_run.id)
            for record in self.history:  # a resumed run that W&B did not follow before: its earlier steps as well
                self._log_wandb(record)

    def _continue_wandb(self, run_id: str, settings: dict[str, Any]) -> Any:
        """The W&B run `run_id`, continued at `resume_step`. W&B refuses a step below the last one it has, so where
        it has the steps the run repeats, the run is rewound (wandb's `resume_from`) to the step before them."""
        import wandb

        if self.last_dropped_step is None:
            return wandb.init(id=run_id, resume="allow", **settings)
        try:
            return wandb.init(resume_from=f"{run_id}?_step={self.resume_step - 1}", **settings)
        except wandb.errors.AuthenticationError:
            raise
        except (wandb.errors.CommError, wandb.errors.UnsupportedError) as exc:  # rewind is a W&B preview feature,
            # not on every account or server; no server at all is start_wandb's error, not a second init_timeout
            if isinstance(exc, wandb.errors.CommError) and "timed out" in str(exc).lower():
                raise  # wandb has no type of its own for "unreachable": 'Timed out while retrying: ...'
            logger.warning("W&B did not rewind run %s to step %d (%s): steps %d..%d are not logged to W&B again, "
                           "which keeps their first values; metrics.jsonl and TensorBoard have the new ones", run_id,
                           self.resume_step - 1, exc, self.resume_step, self.last_dropped_step)
            return wandb.init(id=run_id, resume="allow", **settings)

    def _log_wandb(self, record: dict[str, Any]) -> None:
        self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        self.history.append(record)
        with self.jsonl_path.open("a") as f:
            f.write(_json_line(record))
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, float(value), step)
            self.writer.flush()
        if self.wandb_run is not None:
            self._log_wandb(record)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.history if r.get(key) is not None]
        return [p[0] for p in points], [p[1] for p in points]

    def plot(self, path: Path) -> Path:
        """PNG: train and validation reward over steps, and the stacked per-phase step time (and in the W&B run,
        as `summary/plot` at the last step)."""
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
        for phase in (*PHASES, *OUTSIDE_STEP):
            values = [times.get(phase, 0.0) for times in per_step]  # a phase a step did not have stacks as 0
            if any(values):
                ax_time.bar(steps, values, bottom=bottom, label=phase)
                bottom = [a + b for a, b in zip(bottom, values)]
        ax_time.set(xlabel="step", ylabel="seconds", title="Time by phase (val, checkpoint: outside the step)")
        ax_time.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        if self.wandb_run is not None and self.history:
            import wandb

            self.wandb_run.log({"summary/plot": wandb.Image(str(path))}, step=self.history[-1]["step"])
        return path

    def summary(self) -> str:
        """Validation reward before/after and the mean time per phase, as a text table; then where the metrics are."""
        steps, val = self.series("val/reward_mean")
        lines = []
        if val:  # the first is the base model's unless grpo.val_at_start=false
            first = f"{val[0]:.3f}" + (f" at step {steps[0]}" if steps[0] else "")
            lines.append(f"validation reward: {first} -> {val[-1]:.3f} ({val[-1] - val[0]:+.3f})")
        _, per_record = self._phase_times()
        num_steps = max(1, sum(r.get("timing/step_s") is not None for r in self.history))
        idle = self.steps_without_advantage()
        if idle:
            lines.append(self._without_advantage_line(idle, num_steps))
        lines.append(f"{'phase':<12} {'mean s/step':>12} {'share':>7}")
        means = {phase: sum(t.get(phase, 0.0) for t in per_record) / num_steps for phase in (*PHASES, *OUTSIDE_STEP)
                 if any(phase in t for t in per_record)}
        total = sum(means.values()) or 1.0
        for phase, mean in means.items():
            lines.append(f"{phase:<12} {mean:>12.3f} {mean / total:>6.1%}")
        lines.append(f"{'total':<12} {total:>12.3f}")
        outside = {phase: sum(phase in t for t in per_record) for phase in OUTSIDE_STEP if phase in means}
        if outside:  # a mean over every step, as the rows above, so that the shares add up to the run's time
            done = " and ".join(f"{n} {'validation' if phase == 'val' else phase}{'s' * (n != 1)}"
                                for phase, n in outside.items())
            lines.append(f"{', '.join(outside)}: not in timing/step_s; the run's {done} spread over its {num_steps} steps")
        ahead = [r for r in self.history if r.get("rollout/sampled_ahead")]
        if ahead:
            for phase in SAMPLING:
                mean = sum(r.get(f"timing/{phase}_s") or 0.0 for r in ahead) / len(ahead)
                lines.append(f"{phase + ' *':<12} {mean:>12.3f}")
            lines.append(f"* of the {len(ahead)} steps whose groups were sampled beside the previous step's training "
                         "(grpo.async_rollouts)")
        lines.append(f"metrics: {self.jsonl_path}")
        if self.writer is not None:
            lines.append(f"TensorBoard: tensorboard --logdir {self.log_dir / 'tensorboard'}")
        return "\n".join(lines)

    def steps_without_advantage(self) -> list[int]:
        """The steps whose advantages were all 0 (rollout/advantages_abs_mean 0), in order."""
        return [r["step"] for r in self.history if r.get("rollout/advantages_abs_mean") == 0.0]

    def _without_advantage_line(self, idle: list[int], num_steps: int) -> str:
        """How many steps had no advantage, and from which step on, where every one up to the last did."""
        first = len(idle) - 1  # of the last run of consecutive steps
        while first > 0 and idle[first - 1] == idle[first] - 1:
            first -= 1
        last_step = max(r["step"] for r in self.history if "rollout/advantages_abs_mean" in r)
        tail = f", each one from step {idle[first]} on" if idle[-1] == last_step and first < len(idle) - 1 else ""
        return (f"steps without advantage (every group's completions scored alike, so they trained on the KL term "
                f"alone, if any): {len(idle)} of {num_steps}{tail}")

    def _phase_times(self) -> tuple[list[int], list[dict[str, float]]]:
        """The steps, and the seconds of each phase a step spent itself (not what ran beside the step before), with
        the validation and checkpoint of its record (OUTSIDE_STEP); the last validation's record, without a step, too."""
        steps, per_step = [], []
        for record in self.history:
            beside = SAMPLING if record.get("rollout/sampled_ahead") else ()
            times = {phase: record[f"timing/{phase}_s"] for phase in (*PHASES, *OUTSIDE_STEP)
                     if phase not in beside and record.get(f"timing/{phase}_s") is not None}
            if record.get("timing/step_s") is None and not times:
                continue
            steps.append(record["step"])
            per_step.append(times)
        return steps, per_step

    def close(self, *, failed: bool = False) -> None:
        """`failed`: the run stopped on an error or a signal (its W&B run is marked failed, not finished)."""
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if failed else 0)
            self.wandb_run = None


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
