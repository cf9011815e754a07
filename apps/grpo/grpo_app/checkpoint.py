"""Run checkpoints: engine state plus the trainer's own state, verified, written atomically, keep-top-k.

A checkpoint is `<dir>/step_<N>/` holding `policy/` (written by the engines), `trainer_state.json`
(step, data position, metric, the run's identity) and `MANIFEST.json` (size and sha256 of every file,
written last; rl_core.checkpoint_io). It is assembled under a temporary name and renamed when complete,
so a killed run leaves either a whole checkpoint or none. Resuming takes the newest checkpoint that
verifies against its manifest: a damaged newer one is reported (naming the file) and skipped, and if
none verifies the run stops with an error rather than starting over. The engine's files (`policy/`) are
checked here for presence and size only: the engine hashes them as it loads them, on all its ranks at
once, and a mismatch it finds sends the run back here for the next older checkpoint (main.py). Pruning keeps the `keep_top_k` best
by the configured metric, and always the latest; a pruned checkpoint is renamed away before it is deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_app import program_name
from grpo_app.prompts import PromptSource
from rl_core.checkpoint_io import (
    MANIFEST_FILE,
    CheckpointError,
    DiskFullError,
    atomic_dir,
    format_bytes,
    recover_publish,
    verify_manifest,
    write_manifest,
)
from rl_core.lora import base_model_fingerprint

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
POLICY_DIR = "policy"  # the engine's checkpoint (hashed by the engine when it loads it)
HF_DIR = "hf"  # the policy as a Hugging Face model directory (checkpointing.save_hf)
ADAPTERS_KEY = "lora_cfg"  # an engine section's LoRA settings (run_identity)
BASE_MODEL_KEY = "base_model"  # the fingerprint of the base a LoRA run's adapters apply to (run_identity)


class DamagedOnLoad(Exception):
    """The engine found a file of checkpoint `path` damaged as it loaded it (a changed byte: the sizes the driver
    checks were right); the run starts again from the next older checkpoint (main.py)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


@dataclass
class ResumePoint:
    """The checkpoint a run continues from: its directory and its verified trainer state."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


ROOM_HINT = "Free space there, lower checkpointing.keep_top_k, or set checkpointing.dir to a larger disk"


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


class CheckpointManager:
    def __init__(self, root: Path, *, keep_top_k: int, metric: str, higher_is_better: bool) -> None:
        self.root, self.keep_top_k, self.metric, self.higher_is_better = Path(root), keep_top_k, metric, higher_is_better

    def steps(self) -> list[int]:
        """Steps of every published checkpoint directory, intact or not, oldest first."""
        if not self.root.is_dir():
            return []
        names = (p.name for p in self.root.glob("step_*") if p.is_dir())
        # the names this class writes only: `step_04` (renamed by hand) is no `step_4`, which a later prune renames
        return sorted(int(name[5:]) for name in names if name[5:].isdigit() and name == f"step_{int(name[5:])}")

    def save(self, step: int, save_engine: Callable[[str], None], state: dict[str, Any],
             files: dict[str, bytes] | None = None, save_hf: Callable[[str], None] | None = None,
             before_publish: Callable[[], None] | None = None) -> Path:
        """`save_engine(path)` writes the policy; `state` is the trainer's JSON-serialisable state; `files`, more
        of the trainer's state by file name (the groups sampled ahead); `save_hf(path)`, if given, a Hugging Face
        copy of the policy (`HF_DIR`). `before_publish()` runs once everything is written, before the checkpoint
        appears under its name (the loop logs the step's metrics there: a resume from this checkpoint keeps the
        records before it, so a record logged after it appeared was lost to a kill in between)."""
        final = self.root / f"step_{step}"
        self._recover()
        for stale in self.root.glob(".step_*.tmp-*"):  # what a killed save left behind
            shutil.rmtree(stale, ignore_errors=True)
        state = {**state, "checkpoint_metric_name": self.metric}  # a score means nothing without its metric
        try:
            with atomic_dir(final) as tmp:
                save_engine(str(tmp / POLICY_DIR))
                if save_hf is not None:
                    save_hf(str(tmp / HF_DIR))
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, allow_nan=False))
                for name, data in (files or {}).items():
                    (tmp / name).write_bytes(data)
                write_manifest(tmp)
                if before_publish is not None:
                    before_publish()
        except DiskFullError as exc:
            raise DiskFullError(f"checkpoint {final}: {exc}. {self._room_needed()}") from exc.__cause__
        logger.info("checkpoint saved: %s", final)
        self._prune(saved=step)
        return final

    def _room_needed(self) -> str:
        """What a checkpoint takes (the newest one's size, where there is one) and the ways to make room."""
        steps = self.steps()
        if not steps:
            return ROOM_HINT
        newest = self.root / f"step_{steps[-1]}"
        return (f"Each checkpoint takes about {format_bytes(_tree_bytes(newest))} ({newest.name}), and as one is "
                f"written up to checkpointing.keep_top_k + 2 = {self.keep_top_k + 2} are on the disk (the best, the "
                f"latest, the new one). {ROOM_HINT}")

    def warn_if_no_room(self, newest: Path) -> None:
        """At a resume: a warning where the checkpoint filesystem has less free space than the newest checkpoint
        takes (a run that stopped on a full disk, started again without making room, would fail at its next save)."""
        size, free = _tree_bytes(newest), shutil.disk_usage(self.root).free
        if free < size:
            logger.warning("%s has %s free and the newest checkpoint, %s, takes %s: the next checkpoint will likely "
                           "not fit. %s", self.root, format_bytes(free), newest.name, format_bytes(size), ROOM_HINT)

    def load_state(self, path: Path) -> dict[str, Any]:
        file = path / STATE_FILE
        try:
            state = json.loads(file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing") from None
        except ValueError as exc:
            raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise CheckpointError(f"{file} has no integer 'step'")
        return state

    def newest_intact(self, known_damaged: Mapping[Path, str] | None = None) -> ResumePoint | None:
        """The newest checkpoint that verifies (None if there is none at all); damaged ones are warned about.
        `known_damaged`: checkpoints an engine found damaged as it loaded them (path -> what), passed over without
        a warning (the caller gave one when the engine found it; this runs again after each such find).

        Raises CheckpointError when checkpoints exist but none is intact: starting from step 0 would
        silently overwrite the run's metrics.
        """
        self._refuse_a_single_checkpoint_as_root()
        self._recover()
        known_damaged = known_damaged or {}
        damaged = []
        for step in reversed(self.steps()):
            path = self.root / f"step_{step}"
            if path in known_damaged:
                damaged.append(f"{path.name}: {known_damaged[path]}")
                continue
            try:
                verify_manifest(path, sizes_only_under=(POLICY_DIR,))
                point = ResumePoint(path, self.load_state(path))
                if point.step != step:  # a copy under another name: resuming would log steps it did not train
                    raise CheckpointError(f"its {STATE_FILE} is of step {point.step} (copied or renamed?)")
                return point
            except CheckpointError as exc:
                logger.warning("checkpoint %s is damaged and skipped: %s", path, exc)
                damaged.append(f"{path.name}: {exc}")
        if damaged:
            raise CheckpointError(
                f"no intact checkpoint in {self.root} ({'; '.join(damaged)}). Restore the files, or move the "
                "run directory away (or set logger.log_dir) to start a new run")
        return None

    def _recover(self) -> None:
        """A save that replaced step_N (after a fall-back from a damaged one) and was killed between its two
        renames left only step_N.old: the previous step_N, put back (rl_core.checkpoint_io.recover_publish)."""
        for old in self.root.glob("step_*.old"):
            recover_publish(old.with_suffix(""))

    def _refuse_a_single_checkpoint_as_root(self) -> None:
        """checkpointing.dir set to one checkpoint (`.../step_N`) holds no `step_*`: it would start over."""
        if (self.root / STATE_FILE).is_file() or (self.root / MANIFEST_FILE).is_file():
            raise CheckpointError(
                f"checkpointing.dir={self.root} is one checkpoint, not a directory of checkpoints: set "
                f"checkpointing.dir={self.root.parent} to resume from its newest intact checkpoint (to resume from "
                f"{self.root.name} itself, copy it into an empty directory and set checkpointing.dir to that)")

    def _score(self, step: int) -> float | None:
        path = self.root / f"step_{step}"
        try:  # a damaged checkpoint ranks last (its trainer_state.json may read well: a newer damaged step outranked
            verify_manifest(path, sizes_only_under=(POLICY_DIR,))  # the intact one resumed from)
            state = self.load_state(path)
        except CheckpointError:
            return None
        value = state.get("checkpoint_metric")
        if value is None or state.get("checkpoint_metric_name", self.metric) != self.metric:
            return None  # scored by another checkpointing.metric (a resumed run changed it): not comparable
        return value if self.higher_is_better else -value

    def _prune(self, saved: int) -> None:
        """Keep the `keep_top_k` best intact checkpoints and the one just `saved` (what a resume starts from; not the
        highest-numbered directory, which may be a damaged one the run resumed before)."""
        steps = self.steps()
        if len(steps) <= self.keep_top_k:
            return
        scores = {s: self._score(s) for s in steps}
        scored = sorted(steps, key=lambda s: (scores[s] is not None, scores[s] or 0.0, s), reverse=True)
        keep = set(scored[: self.keep_top_k]) | {saved}
        for step in steps:
            if step not in keep:
                self._delete(step)
                logger.info("checkpoint pruned: step_%d (%s)", step, self.metric)

    def _delete(self, step: int) -> None:
        """Hide the checkpoint by one rename before deleting it: a run killed mid-delete then leaves no
        incomplete `step_N` behind, only a temporary name that the next save removes."""
        hidden = self.root / f".step_{step}.tmp-pruned"
        os.rename(self.root / f"step_{step}", hidden)
        shutil.rmtree(hidden, ignore_errors=True)


def check_prompts(resume_point: ResumePoint, train: PromptSource, *, allow_change: bool) -> None:
    """Refuse to resume on another train prompt stream unless explicitly allowed: a smaller set fails
    mid-run, any other change trains on other prompts than the interrupted run would have."""
    problem = train.resume_problem(resume_point.state["prompts"])
    if problem is None:
        return
    if allow_change:
        logger.warning("resuming %s with other train prompts (checkpointing.allow_config_change=true): %s",
                       resume_point.path, problem)
        return
    raise CheckpointError(
        f"{resume_point.path} cannot continue this run's train prompts: {problem}. Use the original env.train_data "
        "(or env.num_generated_train_prompts) and grpo.seed, another logger.log_dir for a new run, or "
        "checkpointing.allow_config_change=true to resume anyway")


def run_identity(cfg: Any) -> dict[str, Any]:
    """What a checkpoint can only be resumed under: the model, the engine and its layout, its adapters, the task."""
    policy = cfg.policy
    identity = {"policy.model_name": policy.model_name, "policy.engine": policy.engine_name,
                "policy.optimizer.name": policy.optimizer.name,
                "cluster.train_world_size": cfg.cluster.train_world_size, "env.name": cfg.env.name}
    lora = _lora_settings(policy)
    if lora is not None:
        key = f"{policy.engine_options_key}.{ADAPTERS_KEY}"
        identity[key] = {"dim": lora.dim, "target_modules": sorted(set(lora.target_modules)),
                         "exclude_modules": sorted(set(lora.exclude_modules))}
        # alpha loads into the same tensors but rescales the trained update B @ A: the resumed model would not be
        # the checkpointed one. A change is allowed like any other (dropout is not recorded: it changes no output)
        identity[f"{key}.alpha"] = lora.alpha
        # the checkpoint holds the adapters alone, to load onto these base weights: checked here, before Ray, where
        # the engine's own check would come after the workers started and the run directory was rewritten (a
        # tiny:<arch> name not resolved yet has nothing to read)
        if Path(policy.model_name).is_dir():
            identity[f"{key}.{BASE_MODEL_KEY}"] = base_model_fingerprint(policy.model_name)[:16]
    identity.update({f"{policy.engine_options_key}.{key}": value for key, value in sorted(policy.engine_options.items())
                     if key.endswith("parallel_size")})
    return identity


def _lora_settings(policy: Any) -> Any | None:
    """The engine's validated LoRA section (an engine whose config has a `lora_cfg`), None without adapters."""
    from rl_core.interfaces import ValidatesConfig
    from rl_core.registry import ENGINES

    engine_cls = ENGINES.get(policy.engine_name, config_key=policy.engine_config_key)
    engine_cfg = engine_cls.validate_config(policy) if isinstance(engine_cls, ValidatesConfig) else None
    lora = getattr(engine_cfg, ADAPTERS_KEY, None)
    return lora if lora is not None and lora.enabled else None


def _never_loads(key: str) -> bool:
    """An identity key whose change no override can resume across: the engine (its own checkpoint format), the
    optimizer (its state: Adam's moments are not SGD's momentum), the LoRA adapters (which tensors there are) and the
    base model they were trained on."""
    return key in ("policy.engine", "policy.optimizer.name") or key.endswith((f".{ADAPTERS_KEY}", f".{ADAPTERS_KEY}.{BASE_MODEL_KEY}"))


def check_identity(resume_point: ResumePoint, identity: dict[str, Any], *, allow_change: bool) -> None:
    """Refuse to resume under a different model, layout or task unless explicitly allowed; under another engine or
    other LoRA adapters always (`_never_loads`)."""
    saved = resume_point.state.get("identity", {})
    changed = []
    for key in sorted(identity.keys() | saved.keys()):
        if key.endswith("_parallel_size"):  # an unset size is the engine's default (1; expert TP: = TP)
            default = None if key.endswith("expert_tensor_parallel_size") else 1
            old, new = saved.get(key, default), identity.get(key, default)
        elif key.endswith(f".{ADAPTERS_KEY}"):  # recorded with LoRA only: absent is no adapters
            old, new = saved.get(key), identity.get(key)
        elif key not in saved:  # recorded only by newer versions: nothing to compare with
            continue
        else:
            old, new = saved[key], identity.get(key)
        if old != new:
            changed.append(f"{key}: checkpoint {old!r}, config {new!r}")
    if not changed:
        return
    detail = "; ".join(changed)
    unloadable = [change for change in changed if _never_loads(change.split(":")[0])]
    if unloadable:  # the load would fail inside the policy actors, after Ray and the model load
        raise CheckpointError(
            f"{resume_point.path} cannot load into this run ({'; '.join(unloadable)}): another engine's checkpoint "
            "format, another optimizer's state, other LoRA adapters (other tensor names and shapes), or LoRA adapters trained on another base "
            f"model (`{BASE_MODEL_KEY}`: a fingerprint of its weight files), so not even "
            "checkpointing.allow_config_change=true resumes it. Use the checkpoint's values (point policy.model_name at "
            "the base model the run was trained on), or start a new run "
            f"(another logger.log_dir) from it: `{program_name()} export {resume_point.path}` writes it as a Hugging "
            "Face model (LoRA adapters merged) to set as policy.model_name")
    if allow_change:
        logger.warning("resuming %s under a changed config (checkpointing.allow_config_change=true): %s",
                       resume_point.path, detail)
        return
    raise CheckpointError(
        f"{resume_point.path} was written by a different run configuration ({detail}). Use the original "
        "values, another logger.log_dir for a new run, or checkpointing.allow_config_change=true to resume anyway")
