"""TrainingEngine.train_batch, the one template both engines inherit; TokenBatch.dummy (the zero-weight
micro-batch of a rank with fewer micro-batches); FrozenWeights, the weights-only reference (the engines'
tests check it against HF on sharded models)."""

from __future__ import annotations

import pytest
import torch

from rl_core.batch import StepResult, TokenBatch
from rl_core.interfaces import TrainingEngine


class _Recorder(TrainingEngine):
    """Records the calls; returns fixed results (no model needed to check the template's order)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def zero_grad(self) -> None:
        self.calls.append("zero_grad")

    def forward_backward(self, batch, loss_fn, *, forward_only=False) -> StepResult:
        self.calls.append(f"forward_backward(forward_only={forward_only})")
        return StepResult(loss=1.5, metrics={"clip_fraction": 0.25}, num_micro_batches=3)

    def optimizer_step(self) -> dict[str, float]:
        self.calls.append("optimizer_step")
        return {"grad_norm": 2.0, "lr": 1e-3, "skipped": 0.0}

    def _unused(self, *args, **kwargs):
        raise AssertionError("train_batch must not call this")

    compute_logprobs = export_hf_weights = save_hf = save_checkpoint = load_checkpoint = _unused
    offload = onload = _unused


def test_an_engine_missing_a_contract_method_fails_at_construction() -> None:
    class Incomplete(TrainingEngine):
        def zero_grad(self) -> None:
            pass

    with pytest.raises(TypeError, match="abstract method"):
        Incomplete()


def test_train_batch_is_zero_grad_then_forward_backward_then_step() -> None:
    engine = _Recorder()
    batch = TokenBatch(input_ids=[torch.tensor([1, 2, 3])], loss_mask=[torch.tensor([0.0, 1.0, 1.0])])
    metrics = engine.train_batch(batch, loss_fn=None)
    assert engine.calls == ["zero_grad", "forward_backward(forward_only=False)", "optimizer_step"]
    assert metrics == {"clip_fraction": 0.25, "loss": 1.5, "grad_norm": 2.0, "lr": 1e-3, "skipped": 0.0,
                       "num_micro_batches": 3.0}


def test_dummy_batch_has_no_loss_tokens_and_the_same_fields() -> None:
    batch = TokenBatch(input_ids=[torch.tensor([5, 6, 7])], loss_mask=[torch.ones(3)],
                       advantages=[torch.ones(3)], prev_logprobs=[torch.zeros(3)])
    for multiple, length in ((1, 2), (2, 2), (3, 3), (8, 8)):
        dummy = batch.dummy(multiple)
        assert dummy.lengths == [length] and dummy.num_valid_tokens() == 0 and dummy.num_valid_seqs() == 0
        assert dummy.advantages is not None and dummy.prev_logprobs is not None
        assert dummy.gen_logprobs is None and dummy.ref_logprobs is None


def test_frozen_weights_swap_in_and_back_exactly() -> None:
    from rl_core.reference import FrozenWeights

    model = torch.nn.Linear(4, 3)
    initial = [p.detach().clone() for p in model.parameters()]
    reference = FrozenWeights(model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # "training"
    trained = [p.detach().clone() for p in model.parameters()]
    with reference.swapped_in():
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), trained))
    assert reference.nbytes == sum(p.numel() * 4 for p in model.parameters())
    assert not any(t.requires_grad for t in reference.saved)
