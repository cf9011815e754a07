"""The weights-only reference policy: after the policy trained a step, the reference logprobs equal a
separately loaded HF model's on the initial weights (fp32, 1e-5), the policy is bitwise unchanged by the
reference pass, and the reference costs exactly this rank's parameter bytes: no grads, no optimizer state."""

from __future__ import annotations

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import hf_reference_logprobs, make_policy, max_abs_diff
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.distributed import run_distributed
from rl_core.testing.reference import run_reference_check

LENGTHS = [5, 9, 7, 12, 3, 10, 8, 6]


def _check(rank: int, world: int, path: str, snapshot_after_forward: bool) -> dict:
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=2))
    batch = random_token_batch(100, LENGTHS, seed=3)
    mine = list(range(rank, len(batch), world))
    optimizer_tensors = [t for group in engine.optimizer.param_groups for t in group["params"]]
    # the sharded parameters, listed now: after a forward FSDP2 leaves the root module's unsharded ones in place
    params = list(engine.model.parameters())
    result = run_reference_check(engine, batch.select(mine), ClippedPGLoss(), params=params,
                                 optimizer_tensors=optimizer_tensors, snapshot_after_forward=snapshot_after_forward)
    optimizer_tensors += [t for state in engine.optimizer.state.values() for t in state.values()
                          if torch.is_tensor(t) and t.dim() > 0]
    saved = {t.untyped_storage().data_ptr() for t in engine.reference.saved}
    result["reference_in_optimizer"] |= any(t.to_local().untyped_storage().data_ptr() in saved
                                            for t in optimizer_tensors if hasattr(t, "to_local"))
    return {**result, "indices": mine}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("snapshot_after_forward", [False, True], ids=["snapshot_first", "snapshot_after_forward"])
def test_reference_policy_is_the_initial_model_weights_only(ckpt, world: int, snapshot_after_forward: bool) -> None:
    """Also with the snapshot taken after a forward, when FSDP2 holds the root's parameters unsharded (the copy was of
    those, whose storage the next reshard freed: the reference pass segfaulted)."""
    path = ckpt("qwen2")
    batch = random_token_batch(100, LENGTHS, seed=3)
    hf = hf_reference_logprobs(path, batch.input_ids)
    for result in run_distributed(_check, world, args=(path, snapshot_after_forward), timeout=120):
        expected = [hf[i] for i in result["indices"]]
        assert max_abs_diff(result["ref"], expected) <= 1e-5
        assert max_abs_diff(result["policy_before"], expected) > 1e-3  # the policy did move
        assert all(torch.equal(a, b) for a, b in zip(result["policy_before"], result["policy_after"]))
        assert result["reference_bytes"] == result["param_bytes"] > 0
        assert not result["reference_has_grad"] and not result["reference_in_optimizer"]
