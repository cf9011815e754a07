"""`uv run apps/grpo export PATH [--out DIR] [--config FILE]`: a run checkpoint as a Hugging Face model directory.

PATH is a run directory (its newest intact checkpoint) or one `step_N` checkpoint. The run's resolved
`config.yaml` (the checkpoint's grandparent by default) names the engine and the model; the engine class
converts its own checkpoint offline (rl_core.interfaces.ExportsCheckpoint): one CPU process, no Ray, no
process group, weights only. Owns finding the checkpoint and the config and the default output directory;
not the conversion. The output goes beside the checkpoints (`<log_dir>/hf/step_N`), never into a checkpoint,
whose manifest covers every file in it. It is what the run's own `hf/` copy would be: for a LoRA checkpoint the
merged weights and, in `adapter/`, the adapter alone in PEFT format (the engine's converter writes both). A LoRA
checkpoint holds the adapters alone: the base weights come from policy.model_name, or from `--base-model DIR` where
the base has moved (the engine checks that it holds the weights the run trained on).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from grpo_app.checkpoint import POLICY_DIR, STATE_FILE, CheckpointManager, run_identity
from grpo_app.config import GRPOConfig, load_config
from grpo_app.preflight import resolve_model
from rl_core.checkpoint_io import DiskFullError, verify_manifest
from rl_core.config import ConfigError
from rl_core.interfaces import ExportsCheckpoint
from rl_core.registry import ENGINES

logger = logging.getLogger("grpo.export")

CONFIG_FILE = "config.yaml"  # what run_training writes into the run directory (logger.log_dir)


@dataclass
class ExportPlan:
    """What to convert (a verified checkpoint directory) and where to (a directory that does not exist)."""

    checkpoint: Path
    out: Path


def plan_export(path: Path, config: str | None, out: str | None) -> tuple[ExportPlan, GRPOConfig]:
    """The checkpoint (verified), the run's config and the output directory; ValueError naming the fix."""
    path = Path(os.path.abspath(path))  # `.` or `step_2` name no parent of their own: the config is found above
    if not path.is_dir():
        raise ValueError(f"{path} does not exist: pass a run directory (logger.log_dir) or one of its "
                         "checkpoints/step_N")
    is_checkpoint = (path / STATE_FILE).is_file() or (path / POLICY_DIR).is_dir()
    config_file = Path(config) if config else (path.parent.parent if is_checkpoint else path) / CONFIG_FILE
    if not config_file.is_file():
        inside = next((p for p in (path, *path.parents) if (p / CONFIG_FILE).is_file()), None)
        if config is None and inside is not None:  # checkpoints/ or step_N/policy of a run: name what to pass
            raise ValueError(f"{path} is neither a run directory nor one of its checkpoints/step_N: pass {inside} "
                             f"(its newest intact checkpoint) or {inside}/checkpoints/step_N")
        raise ValueError(f"{config_file} is missing: pass the run's resolved config with --config FILE (the "
                         "config.yaml a run writes into its logger.log_dir)")
    cfg = load_config(config_file)
    if is_checkpoint:
        # CheckpointError (a ValueError) names the damaged file; the engine's checkpoint_to_hf hashes policy/
        verify_manifest(path, sizes_only_under=(POLICY_DIR,))
        checkpoint = path
    else:
        checkpoint = _newest_intact(cfg, path)
    target = Path(out) if out else config_file.parent / "hf" / checkpoint.name
    if target.exists():
        raise ValueError(f"{target} already exists; remove it or choose another --out")
    if _is_checkpoint_space(target, checkpoint.parent):
        raise ValueError(f"--out {target} is inside a checkpoint or takes a checkpoint's name (step_N) in "
                         f"{checkpoint.parent}: the trainer deletes step_N directories whole (keep-top-k) and no "
                         "checkpoint's manifest covers the export; choose a directory outside them (default: "
                         "<log_dir>/hf/step_N)")
    return ExportPlan(checkpoint, target), cfg


def _is_checkpoint_space(target: Path, root: Path) -> bool:
    """`target` lies inside a checkpoint (a directory above it holds its trainer state), or is named as one in the
    directory of checkpoints `root` (the trainer would take it for a damaged checkpoint, and prune it)."""
    target = target.resolve()
    return (any((parent / STATE_FILE).is_file() for parent in target.parents)
            or (target.parent == root.resolve() and target.name.startswith("step_")))


def _newest_intact(cfg: GRPOConfig, run_dir: Path) -> Path:
    """The newest verified checkpoint of a run directory (its checkpointing.dir if the run set one)."""
    root = Path(cfg.checkpointing.dir) if cfg.checkpointing.dir else run_dir / "checkpoints"
    point = CheckpointManager(root, keep_top_k=cfg.checkpointing.keep_top_k, metric=cfg.checkpointing.metric,
                              higher_is_better=cfg.checkpointing.higher_is_better).newest_intact()
    if point is None:
        raise ValueError(f"{root} holds no checkpoint: export a run that saved one (checkpointing.enabled=true, "
                         "checkpointing.save_every), or pass a checkpoints/step_N directory")
    return point.path


def check_config_wrote(checkpoint: Path, cfg: GRPOConfig, keys: tuple[str, ...] = ("policy.model_name",
                                                                                    "policy.engine")) -> None:
    """The (resolved) config names the model and the engine the checkpoint recorded (`keys`): an edited or another
    run's config.yaml would convert with another architecture (a converter's error about a missing tensor) or, where
    the shapes agree, silently with another model's config.json and tokenizer. The parallel layout does not matter
    offline, and a LoRA checkpoint carries its own adapter settings (the engine's)."""
    saved = json.loads((checkpoint / STATE_FILE).read_text()).get("identity", {})
    current = run_identity(cfg)
    changed = [f"{key}: checkpoint {saved[key]!r}, config {current[key]!r}" for key in keys
               if key in saved and saved[key] != current[key]]
    if changed:
        raise ValueError(f"{checkpoint} was not written under this config ({'; '.join(changed)}): pass the config.yaml "
                         "of the run that wrote it with --config FILE, or restore the run's own config.yaml; where only "
                         "the base model has moved, pass its directory with --base-model DIR")


def export(plan: ExportPlan, cfg: GRPOConfig, base_model: str | None = None) -> None:
    """Resolve the engine class and the model directory as the trainer does (or take `base_model`, the run's base
    where it is now), check them against the checkpoint, then convert."""
    if base_model is None:
        cfg = _resolve_run_model(cfg)
        check_config_wrote(plan.checkpoint, cfg)
    else:  # another path than the recorded one: the engine's converter checks the weights (LoRA: the fingerprint)
        if not Path(base_model).is_dir():
            raise ConfigError(f"--base-model {base_model}: no such directory; pass the directory the run's base model "
                              f"({cfg.policy.model_name}) is in now")
        cfg = resolve_model(dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, model_name=base_model)))
        check_config_wrote(plan.checkpoint, cfg, keys=("policy.engine",))
    policy = cfg.policy
    engine_cls = ENGINES.get(policy.engine_name, config_key=policy.engine_config_key)
    if not isinstance(engine_cls, ExportsCheckpoint):
        raise ValueError(f"engine '{policy.engine_name}' ({engine_cls.__qualname__}) cannot convert its checkpoints "
                         "offline (no checkpoint_to_hf classmethod); export with the engine itself "
                         "(checkpointing.save_hf, or its save_hf on the run's layout)")
    logger.info("exporting %s (engine '%s', model %s) to %s", plan.checkpoint, policy.engine_name,
                policy.model_name, plan.out)
    engine_cls.checkpoint_to_hf(str(plan.checkpoint / POLICY_DIR), str(plan.out), model_dir=policy.model_name)
    logger.info("exported: %s (loads with transformers.AutoModelForCausalLM.from_pretrained and vLLM)", plan.out)
    if (plan.out / "adapter").is_dir():  # a LoRA run's: easy to miss inside the merged model's directory
        logger.info("the LoRA adapter alone (peft, vLLM --enable-lora; on %s, not on the merged weights): %s",
                    policy.model_name, plan.out / "adapter")


def _resolve_run_model(cfg: GRPOConfig) -> GRPOConfig:
    """`resolve_model` (tiny:<arch> names rebuild the same cached checkpoint); a model directory that is gone is
    named with the option that points at where it is now."""
    try:
        return resolve_model(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{exc}; if the run's base model has moved, pass its directory with --base-model DIR") from None


def run(args: argparse.Namespace) -> int:
    """`export` with its parsed options (grpo_app.cli.parse_export_args): exit 0 with the model directory written, 2
    with one line naming the problem and the fix, 130 on Ctrl-C."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        plan, cfg = plan_export(Path(args.path), args.config, args.out)
        export(plan, cfg, args.base_model)
    except (ConfigError, FileNotFoundError, ValueError, DiskFullError) as exc:  # CheckpointError is a ValueError
        logger.error("%s", exc)
        return 2
    except KeyboardInterrupt:  # one line, as the trainer and eval: the converters publish the directory whole
        logger.error("export stopped: interrupted; no output directory was written")
        return 130
    return 0
