"""Checks that run before any worker starts: every input the run needs exists and is valid.

Resolves `tiny:<arch>` model names to a locally built, cached tiny checkpoint (the CPU default), and
asks the registries for the engine, generation backend and environment, so that a typo or a missing
package fails here with a message naming the key, not minutes later inside a Ray actor.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from grpo_app.config import GRPOConfig
from grpo_app.devices import check_hardware, detect_hardware
from grpo_app.model_shapes import SHAPE_PREFIX, cached_shape_checkpoint
from rl_core.config import ConfigError
from rl_core.interfaces import ValidatesConfig
from rl_core.registry import ENGINES, GENERATION_BACKENDS

logger = logging.getLogger(__name__)
TINY_PREFIX = "tiny:"


def resolve_model(cfg: GRPOConfig) -> GRPOConfig:
    name = cfg.policy.model_name
    if name.startswith(TINY_PREFIX):
        from rl_core.testing.tiny_models import ARCHITECTURES, cached_tiny_checkpoint

        arch = name[len(TINY_PREFIX):]
        if arch not in ARCHITECTURES:
            raise ConfigError(f"policy.model_name={name!r}: tiny architectures are {list(ARCHITECTURES)}")
        path = cached_tiny_checkpoint(arch, seed=cfg.grpo.seed)
        logger.info("policy.model_name=%s -> tiny %s checkpoint built locally at %s", name, arch, path)
        name = str(path)
    if name.startswith(SHAPE_PREFIX):
        name = str(cached_shape_checkpoint(name[len(SHAPE_PREFIX):], seed=cfg.grpo.seed))
    if not (Path(name) / "config.json").is_file():
        raise ConfigError(
            f"policy.model_name={name!r} is not a local Hugging Face checkpoint directory (no config.json); "
            "point it at a directory saved with save_pretrained, or use tiny:<arch> for a local toy model"
        )
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, model_name=name))


def preflight(cfg: GRPOConfig) -> GRPOConfig:
    """Validate what the config points at; returns the config with the model path resolved."""
    cfg = resolve_model(cfg)
    check_hardware(cfg.cluster, detect_hardware())
    engine_cls = ENGINES.get(cfg.policy.engine_name, config_key=cfg.policy.engine_config_key)
    if isinstance(engine_cls, ValidatesConfig):
        engine_cls.validate_config(cfg.policy)
    GENERATION_BACKENDS.get(cfg.generation.backend, config_key="generation.backend")
    from rollout.environments import environment_names, toy_prompts

    if cfg.env.name not in environment_names():
        raise ConfigError(f"env.name={cfg.env.name!r} is not known; choose one of {environment_names()}")
    for key in ("train_data", "val_data"):
        path = getattr(cfg.env, key)
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"env.{key}={path!r} does not exist (a local .jsonl or .parquet file)")
    if cfg.env.train_data is None or (cfg.env.val_data is None and cfg.grpo.val_every):
        try:
            toy_prompts(cfg.env.name, 1, **cfg.env.prompt_kwargs)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"env.name={cfg.env.name!r} has no built-in prompts ({exc}); set env.train_data and env.val_data "
                "to local prompt files"
            ) from exc
    return cfg
