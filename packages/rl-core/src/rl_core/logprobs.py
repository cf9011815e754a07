"""The logprob convention shared by engines and rollout backends.

Logits are divided by the sampling temperature before the log-softmax, in float32, so that a trainer's
recomputed logprobs and a sampler's logprobs describe the same distribution. Results are aligned with
the tokens (rl_core.batch): position 0 gets 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[target] for logits (..., V) and targets (...) -> (...) float32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def shift_align(next_token_logprobs: Tensor) -> Tensor:
    """(..., L-1) logprobs of tokens 1..L-1 -> (..., L) aligned with the tokens, 0 at position 0."""
    pad = next_token_logprobs.new_zeros(*next_token_logprobs.shape[:-1], 1)
    return torch.cat([pad, next_token_logprobs], dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T) over the last dim, float32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)
