"""The refit group moves named tensors of any dtype and shape from rank 0 to every receiver exactly."""

from __future__ import annotations

import pytest
import torch

from grpo_app.refit import RefitGroup
from rl_core.testing.distributed import free_port, run_distributed


def tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 7, generator=gen)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(3, 2, 2, generator=gen, dtype=torch.float64)),
        ("scalar", torch.tensor(4, dtype=torch.int64)),
    ]


def _refit(rank: int, world_size: int, port: int):
    group = RefitGroup("127.0.0.1", port, rank, world_size)
    if rank == 0:
        return group.send(tensors())
    return list(group.receive())


@pytest.mark.distributed
def test_refit_broadcasts_every_tensor_bit_exactly():
    results = run_distributed(_refit, world_size=3, args=(free_port(),))
    sent = tensors()
    assert results[0] == sum(t.numel() * t.element_size() for _, t in sent)
    for received in results[1:]:
        assert [n for n, _ in received] == [n for n, _ in sent]
        for (_, a), (_, b) in zip(received, sent):
            assert a.dtype == b.dtype and torch.equal(a, b)
