"""Vocab-parallel target logprobs and entropy (rl_core's kernel on the DTensor engine's torch.chunk vocabulary
layout, TP=2 over gloo) against float64 log_softmax over the full vocabulary."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rl_core.logprobs import vocab_parallel_logprobs
from rl_core.testing.distributed import run_distributed

N, V, T = 24, 37, 0.7  # V not divisible by 2: the last shard is smaller (torch.chunk layout)


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        3 * torch.randn(N, V, generator=gen),
        torch.randint(0, V, (N,), generator=gen),
        torch.randn(N, generator=gen),
    )


def _reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, targets, weights = _data()
    x = logits.double().requires_grad_()
    logp = torch.log_softmax(x / T, -1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    (lp * weights.double()).sum().backward()
    entropy = -(logp.exp() * logp).sum(-1)
    return lp.detach(), x.grad, entropy.detach()


def _sharded(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits, targets, weights = _data()
    chunk = -(-V // world)
    local = logits[:, rank * chunk : (rank + 1) * chunk].clone().requires_grad_()
    group = dist.group.WORLD if world > 1 else None
    lp, entropy = vocab_parallel_logprobs(local, targets, vocab_start=rank * chunk, group=group, temperature=T,
                                          chunk_tokens=5, with_entropy=True)
    (lp * weights).sum().backward()
    return lp.detach(), local.grad, entropy


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_vocab_parallel_matches_full_log_softmax(world: int) -> None:
    ref_lp, ref_grad, ref_entropy = _reference()
    results = run_distributed(_sharded, world)
    lp = results[0][0]
    grad = torch.cat([r[1] for r in results], dim=-1)  # each rank's grad covers its vocab slice only
    assert all(torch.equal(r[0], lp) for r in results)  # every rank gets the full answer
    # float32 against float64: 1e-6 absolute plus 1e-6 relative (logprobs reach -20, ~8 ulp at that size)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[0][2].double(), ref_entropy, atol=1e-6, rtol=1e-6)
