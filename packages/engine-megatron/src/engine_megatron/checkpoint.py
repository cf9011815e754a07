"""Engine checkpoints with megatron's dist_checkpointing: model, optimizer, scheduler and RNG.

Owns the on-disk layout of an engine checkpoint: one `dist_checkpointing` directory holding the model's
sharded state (a LoRA run's: the adapters alone; the frozen base is the base model's, which the engine converts from
its HF directory, and the engine records its fingerprint beside the checkpoint), the distributed optimizer's state
in the `fully_reshardable` layout (loadable under another DP size), the scheduler (common state) and one RNG file
per rank. Written into a temporary directory beside `path`, listed in a checksum manifest and renamed into place
only after every rank has finished, so a crash never leaves a half-written checkpoint under `path`, and a damaged
one is refused before megatron reads (and unpickles) it. RNG files hold tensors and plain values (loaded weights_only).
On load the optimizer settings stay the configured ones (lr and weight decay: the scheduler; betas, eps:
here), as in the DTensor engine; only the schedule's position comes from the checkpoint.
"""

from __future__ import annotations

import logging
import multiprocessing
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine_megatron import lora
from engine_megatron.compat import device_context
from engine_megatron.model import gpt_model
from rl_core import checkpoint_io

logger = logging.getLogger(__name__)

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
CONFIGURED_SETTINGS = ("betas", "eps", "momentum")
# param-group keys the scheduler takes from policy.optimizer (the same in every group of this engine), which
# megatron-core >= 0.19 also uses to pair saved groups with the current ones
SCHEDULED_GROUP_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
# the scheduler's settings from policy.optimizer (lr, weight decay), which the config sets on resume (optim.py)
SCHEDULER_SETTINGS = ("max_lr", "min_lr", "start_wd", "end_wd")


def _sharded_state(model: Any, optimizer: Any, scheduler: Any, *, is_loading: bool,
                   adapters_only: bool) -> dict[str, Any]:
    model_sd = gpt_model(model).sharded_state_dict()
    if adapters_only:  # the distributed optimizer pairs its state with the adapters, the only parameters it holds
        model_sd = {key: value for key, value in model_sd.items() if lora.is_adapter(key)}
    return {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA),
        "scheduler": scheduler.state_dict(),  # plain values: common state, written by rank 0
    }


def _materialize_adam_state(optimizer: Any) -> None:
    """Create torch Adam's lazily-built state (step 0, zero moments: what its first step() creates).

    Without Apex/TE, DistributedOptimizer.state_dict() asserts on the 'step' of that state, so saving
    before the first step fails (engine_megatron.fallback_fixes covers only the loading side of this).
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                              exp_avg_sq=torch.zeros_like(param))


def _use_forked_results_queue() -> None:
    """Give megatron's async file writer a results queue served by a forked Manager process.

    megatron creates it with the *spawn* context: the spawned server re-imports `__main__`, which costs
    ~20 s per process on a loaded machine, and hangs forever in a script without a
    `if __name__ == "__main__"` guard (shared/notes/megatron-cpu-probe/part2). A forked Manager does the
    same job without re-importing anything.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def _configured_settings(optimizer: Any) -> list[dict[str, Any]]:
    """The param groups' settings that come from policy.optimizer alone (the scheduler sets lr and weight decay)."""
    return [{key: group[key] for key in CONFIGURED_SETTINGS if key in group} for group in optimizer.param_groups]


def _pair_saved_groups_with_the_config(saved: Any, optimizer: Any) -> None:
    """megatron-core >= 0.19 pairs each saved param group with the current one whose identifying keys it
    shares, the scheduled lr and weight decay among them: after a change of policy.optimizer none paired
    (KeyError in load_state_dict). The saved groups take the current values of those keys, which the config
    sets alike for every group; 0.16 pairs groups by position and reads none of them."""
    current = {key: {group.get(key) for group in optimizer.param_groups} for key in SCHEDULED_GROUP_KEYS}
    uniform = {key: values.pop() for key, values in current.items() if len(values) == 1}
    for groups in _saved_param_groups(saved):
        for group in groups:
            group.update({key: value for key, value in uniform.items() if key in group})


def _saved_param_groups(state: Any) -> Iterator[list[dict[str, Any]]]:
    """Every `param_groups` list in a loaded optimizer state (one per optimizer of a ChainedOptimizer, whose
    state nests them by index)."""
    if isinstance(state, dict):
        if "param_groups" in state:
            yield state["param_groups"]
            return
        for value in state.values():
            yield from _saved_param_groups(value)
    elif isinstance(state, list):
        for value in state:
            yield from _saved_param_groups(value)


def _restore_configured_settings(path: str, optimizer: Any, configured: list[dict[str, Any]],
                                 scheduled: list[str]) -> None:
    """The run's config, not the checkpoint, sets betas and eps: optimizer.load_state_dict brings back the saving
    run's, which would silently override a changed policy.optimizer (the DTensor engine follows the config too).
    `scheduled`: the changed lr / weight decay the scheduler applies (named in the same warning)."""
    changes = sorted({*checkpoint_io.changed_settings(configured, _configured_settings(optimizer)), *scheduled})
    if changes:
        logger.warning("%s was saved with other optimizer settings; the configured ones apply: %s",
                       path, ", ".join(changes))
    for group, settings in zip(optimizer.param_groups, configured):
        group.update(settings)


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {**checkpoint_io.rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    checkpoint_io.set_rng_state(state)
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _common_path(path: str) -> Path:
    """A checkpoint is collective and has one location: global rank 0's `path` (warn if a rank differs)."""
    box = [str(path)]
    dist.broadcast_object_list(box, src=0)
    if box[0] != str(path):
        logger.warning("rank %d was given checkpoint path %s but rank 0 %s: using rank 0's (the path must be "
                       "on storage shared by all ranks)", dist.get_rank(), path, box[0])
    return Path(box[0])


def save(path: str, model: Any, optimizer: Any, scheduler: Any,
         write_side_files: Callable[[Path], None] | None = None, *, adapters_only: bool = False) -> None:
    """Write everything under `path` atomically (temp dir + rename after a barrier); `adapters_only` (LoRA): of
    the model, its adapters alone.

    `write_side_files(dir)` (rank 0) adds files beside the engine state before the manifest is written.
    """
    from megatron.core import dist_checkpointing

    final = _common_path(path)
    box = [f".{final.name}.tmp-{uuid.uuid4().hex[:8]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    tmp = final.parent / box[0]
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True)  # dist_checkpointing.save wants an existing, empty directory
    dist.barrier()
    _materialize_adam_state(optimizer)
    _use_forked_results_queue()
    with device_context():
        dist_checkpointing.save(_sharded_state(model, optimizer, scheduler, is_loading=False,
                                               adapters_only=adapters_only), str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0 and write_side_files is not None:
        write_side_files(tmp)
    dist.barrier()
    checkpoint_io.write_manifest_on_all_ranks(tmp)  # last: its presence says the directory is complete
    if dist.get_rank() == 0:
        checkpoint_io.publish_dir(tmp, final)
    dist.barrier()
    logger.info("saved engine checkpoint to %s", final)


def load(path: str, model: Any, optimizer: Any, scheduler: Any, check_side_files: Callable[[Path], None] | None = None,
         *, adapters_only: bool = False) -> None:
    """Restore model (`adapters_only`: its adapters; the rest stays as loaded), optimizer, scheduler and (when saved
    with the same world size) this rank's RNG. `check_side_files(dir)` raises if the files `save` wrote beside the
    state do not fit this engine: after the manifest is verified, before anything is loaded."""
    from megatron.core import dist_checkpointing

    path = str(_common_path(path))
    if not Path(path, "metadata.json").exists() and not Path(path, checkpoint_io.MANIFEST_FILE).exists():
        raise ValueError(f"{path} is not an engine checkpoint (no metadata.json); pass a directory that "
                         "MegatronEngine.save_checkpoint wrote")
    # before dist_checkpointing reads (and unpickles) anything in it; names a listed file that is missing
    checkpoint_io.verify_manifest_on_all_ranks(path)
    if check_side_files is not None:
        check_side_files(Path(path))
    with device_context():
        state = dist_checkpointing.load(_sharded_state(model, optimizer, scheduler, is_loading=True,
                                                       adapters_only=adapters_only), path)
    missing, unexpected = gpt_model(model).load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and (lora.is_adapter(k) or not adapters_only)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    configured = _configured_settings(optimizer)
    _pair_saved_groups_with_the_config(state["optimizer"], optimizer)
    with torch.no_grad(), device_context():
        optimizer.load_state_dict(state["optimizer"])
    scheduled = ([] if scheduler.use_checkpoint_opt_param_scheduler else  # megatron_cfg.scheduler asked for the saved
                 checkpoint_io.changed_settings([{key: getattr(scheduler, key) for key in SCHEDULER_SETTINGS}],
                                                [{key: state["scheduler"][key] for key in SCHEDULER_SETTINGS
                                                  if key in state["scheduler"]}]))
    _restore_configured_settings(path, optimizer, configured, scheduled)
    scheduler.num_steps = 0  # megatron's load_state_dict adds the saved step count to the current one
    scheduler.load_state_dict(state["scheduler"])
    rng_file = Path(path, f"rng_rank{dist.get_rank()}.pt")
    if rng_file.exists():
        _set_rng_state(checkpoint_io.load_tensors(rng_file))
    else:
        logger.warning("%s has no RNG state for rank %d (saved with another world size): RNG not restored",
                       path, dist.get_rank())
