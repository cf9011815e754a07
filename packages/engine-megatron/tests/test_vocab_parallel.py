"""Vocab-parallel logprobs / entropy (TP=2, padded vocabulary) against a float64 full-vocabulary reference."""

from __future__ import annotations

import pytest
import torch

from rl_core.testing.distributed import run_distributed

VOCAB, TEMPERATURE = 100, 0.7


def _inputs(padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, padded, generator=gen) * 3  # (B, S, V_padded)
    logits[..., VOCAB:] = 50.0  # padded columns: huge logits that must not count
    targets = torch.randint(0, VOCAB, (2, 5), generator=gen)
    return logits, targets


def _worker(rank: int, world_size: int, padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from engine_megatron.vocab_parallel import vocab_parallel_logprobs

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        logits, targets = _inputs(padded)
        local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_(True)  # (B, S, V/TP)
        logprobs, entropy = vocab_parallel_logprobs(local, targets, VOCAB, TEMPERATURE, chunk_tokens=3,
                                                    with_entropy=True)
        (logprobs * torch.arange(1.0, 11.0).reshape(2, 5)).sum().backward()
        return logprobs.detach(), entropy, local.grad
    finally:
        ps.destroy_model_parallel()


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "padded"), [(1, 128), (2, 128), (2, 256)])  # 256: rank 1 holds only padding
def test_vocab_parallel_matches_float64_reference(tp: int, padded: int) -> None:
    logits, targets = _inputs(padded)
    full = logits[..., :VOCAB].double().requires_grad_(True)
    logp = torch.log_softmax(full / TEMPERATURE, -1)
    ref_lp = logp.gather(-1, targets[..., None])[..., 0]
    ref_entropy = -(logp.exp() * logp).sum(-1)
    (ref_lp * torch.arange(1.0, 11.0, dtype=torch.float64).reshape(2, 5)).sum().backward()
    ref_grad = torch.cat([full.grad, torch.zeros(2, 5, padded - VOCAB, dtype=torch.float64)], -1)
    results = run_distributed(_worker, world_size=tp, args=(padded,))
    for rank, (lp, entropy, grad) in enumerate(results):
        # float32 against float64, relative 1e-6 too: logprobs reach -21 and gradients 14 (1 ulp ~ 1e-6 there)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(entropy.double(), ref_entropy.detach(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(grad.double(), ref_grad.chunk(tp, -1)[rank], atol=1e-6, rtol=1e-6)
