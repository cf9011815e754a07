"""Token sampling for the torch backend: temperature, top-k, top-p, seeded draws, sampled-token logprobs.

Logprob convention (rl_core.logprobs): the reported logprob of a sampled token is
log_softmax(logits / T)[token] in float32 over the FULL vocabulary, whatever top-k / top-p did to the
sampling distribution, because that is what a trainer recomputes from the same weights. Greedy decoding
(T = 0) reports the logprobs at T = 1.

Draws use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1)), which picks token i
with probability p_i and needs one random tensor per step from a seeded `torch.Generator`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rl_core.interfaces import SamplingParams


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError naming the field for sampling parameters no backend can honour."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n={params.n}; expected >= 1 completions per prompt")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens}; expected >= 1")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise ValueError(f"SamplingParams.temperature={params.temperature}; expected a finite value >= 0 (0 = greedy)")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p={params.top_p}; expected 0 < top_p <= 1 (1 disables it)")
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k={params.top_k}; expected >= 0 (0 disables it)")


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (the argmax always survives)."""
    if top_k <= 0 and top_p >= 1.0:
        return logits_BV
    vocab = logits_BV.shape[-1]
    sorted_logits, order = logits_BV.sort(dim=-1, descending=True)  # (B, V)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < vocab:
        drop[:, top_k:] = True
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # A token is kept while the mass strictly before it is < top_p (so the top token is always kept).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p
    drop_V = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits_BV.masked_fill(drop_V, float("-inf"))


def sample_next(
    logits_BV: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Next token ids (B,) and their float32 logprobs (B,) from last-position logits (B, V)."""
    logits = logits_BV.float()
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    tokens = (probs / race).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded with `seed`, or from fresh entropy when seed is None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen
