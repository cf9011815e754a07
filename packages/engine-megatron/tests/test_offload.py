"""The storage mover behind `offload` / `onload`, on CPU (where `offload` itself has nothing to move).

`keep_weights` (the offload before a refit) must free every storage of the training state (grad buffers,
the optimizer's main params and moments, the reference copy) and keep every storage the parameters live
in, including, with fp32 params, the optimizer's shards that are views into them; the full offload then
frees the rest, and onload brings all of it back so that training continues bit for bit like an engine
that never moved (bf16 and fp32 params: the optimizer's tensors alias the params in one, not the other).
"""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import LOSS, global_batch, make_policy

from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed


def _exported(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.export_hf_weights()}


def _run(rank: int, world_size: int, ckpt: str, precision: str, megatron_cfg: dict) -> dict:
    from engine_megatron.engine import MegatronEngine

    batch, loss = global_batch(seed=2), ClippedPGLoss(LOSS)
    moved, still = (MegatronEngine(make_policy(ckpt, megatron_cfg, precision=precision)) for _ in range(2))
    out: dict = {}
    for engine in (moved, still):
        engine.snapshot_reference()
        engine.train_batch(batch, loss)
    exported = _exported(moved)
    params = [p.untyped_storage() for p in moved.model.parameters()]
    training_state = [t.untyped_storage() for t in moved._device_tensors()
                      if all(t.untyped_storage().data_ptr() != s.data_ptr() for s in params)]

    moved._storages_to_host(keep_weights=True)
    out["weights_kept"] = all(s.nbytes() > 0 for s in params)
    out["training_state_freed"] = bool(training_state) and all(s.nbytes() == 0 for s in training_state)
    out["export_unchanged"] = all(torch.equal(a, exported[n]) for n, a in _exported(moved).items())
    moved._storages_to_host(keep_weights=False)
    out["weights_freed"] = all(s.nbytes() == 0 for s in params)
    moved.onload()

    for engine in (moved, still):
        engine.train_batch(batch, loss)
    out["same_step"] = all(torch.equal(a, b) for a, b in zip(moved.compute_logprobs(batch),
                                                              still.compute_logprobs(batch)))
    out["same_reference"] = all(torch.equal(a, b) for a, b in zip(moved.compute_ref_logprobs(batch),
                                                                   still.compute_ref_logprobs(batch)))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize(("precision", "megatron_cfg"), [
    ("float32", {}), ("bfloat16", {}),
    # LoRA: the frozen base lives in no DDP buffer, the reference is the base itself (no copy)
    ("float32", {"lora_cfg": {"enabled": True, "dim": 4}}),
], ids=["float32", "bfloat16", "lora"])
def test_offload_keeps_weights_for_the_refit_and_restores_everything(tiny_ckpt, precision: str,
                                                                     megatron_cfg: dict) -> None:
    result = run_distributed(_run, world_size=1, args=(tiny_ckpt("qwen2"), precision, megatron_cfg))[0]
    assert result == {"weights_kept": True, "training_state_freed": True, "export_unchanged": True,
                      "weights_freed": True, "same_step": True, "same_reference": True}, result
