"""One check of an engine's weights-only reference policy (`rl_core.interfaces.ReferencePolicy`), run inside
each rank by both engines' tests; the tests compare its results with an independent HF model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from rl_core.batch import LossFn, TokenBatch
from rl_core.reference import local_tensor


def run_reference_check(engine: Any, batch: TokenBatch, loss_fn: LossFn, *, params: Iterable[Tensor],
                        optimizer_tensors: Iterable[Tensor], snapshot_after_forward: bool = False) -> dict[str, Any]:
    """Snapshot the reference (as the trainer does, before any forward; or after one), train one step, then run
    the reference and the policy passes.

    params: the engine's parameters as this rank's shards (listed before any forward); optimizer_tensors: every parameter and state
    tensor its optimizer holds. Returns the logprobs and the memory facts the tests assert on.
    """
    params = list(params)
    if not snapshot_after_forward:
        engine.snapshot_reference()
    prev = engine.compute_logprobs(batch)
    if snapshot_after_forward:
        engine.snapshot_reference()
    engine.train_batch(batch.with_fields(prev_logprobs=prev), loss_fn)
    policy_before = engine.compute_logprobs(batch)
    ref = engine.compute_ref_logprobs(batch)
    policy_after = engine.compute_logprobs(batch)
    saved = engine.reference.saved
    held_by_optimizer = {local_tensor(t).untyped_storage().data_ptr() for t in optimizer_tensors}
    return {
        "ref": ref, "initial": prev, "policy_before": policy_before, "policy_after": policy_after,
        "reference_bytes": engine.reference.nbytes,
        "param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
        "reference_has_grad": any(t.requires_grad or t.grad is not None for t in saved),
        "reference_in_optimizer": any(local_tensor(t).untyped_storage().data_ptr() in held_by_optimizer for t in saved),
    }
