"""Entry point: `uv run apps/grpo [--config FILE] [dotted.key=value ...]`.

Parses and validates the whole config, checks inputs before any worker starts, builds the run,
resumes from the newest intact checkpoint in the run directory if there is one, trains, and prints a summary.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import yaml

from grpo_app.build import RunInputs, find_resume_point, load_inputs
from grpo_app.checkpoint import ResumePoint, check_prompts
from grpo_app.config import GRPOConfig, load_config
from grpo_app.preflight import preflight
from rl_core.config import ConfigError, to_dict
from rollout.environments.base import RewardFailureError

logger = logging.getLogger("grpo")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="uv run apps/grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file, or the name of a shipped one (e.g. gpu_1x; default: cpu_default)")
    parser.add_argument("--log-level", default="INFO", help="Python logging level")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. grpo.max_steps=5")
    return parser.parse_args(argv)


def run_training(cfg: GRPOConfig, inputs: RunInputs, resume_point: ResumePoint | None = None) -> dict[str, float]:
    """Build the workers and run the loop (from `resume_point` if given); returns the final validation metrics."""
    from grpo_app.build import build_run, resume

    log_dir = Path(cfg.logger.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    logger.info("resolved config (saved to %s):\n%s", log_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run = build_run(cfg, inputs, resume_point)
    try:
        from grpo_app.loop import train

        train(run, start_step=resume(run, resume_point))
        if cfg.logger.plot:
            logger.info("plot: %s", run.sink.plot(log_dir / "summary.png"))
        logger.info("summary:\n%s", run.sink.summary())
        _, val = run.sink.series("val/reward_mean")
        return {"val_reward_first": val[0], "val_reward_last": val[-1]} if val else {}
    finally:
        run.sink.close()
        run.workers.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # everything a run reads is checked here, before Ray or any worker starts
        cfg = preflight(load_config(args.config, args.overrides))
        inputs = load_inputs(cfg)
        resume_point = find_resume_point(cfg)
        if resume_point is not None:
            check_prompts(resume_point, inputs.train, allow_change=cfg.checkpointing.allow_config_change)
    except (ConfigError, FileNotFoundError, ValueError) as exc:  # CheckpointError is a ValueError
        logger.error("%s", exc)
        return 2
    try:
        run_training(cfg, inputs, resume_point)
    except ConfigError as exc:  # found only once Ray runs (e.g. cluster.address answers but is no Ray)
        logger.error("%s", exc)
        return 2
    except RewardFailureError as exc:  # the reward function is broken: one line, not a Ray traceback
        logger.error("%s", exc)
        return 1
    return 0
