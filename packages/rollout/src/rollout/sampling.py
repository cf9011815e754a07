"""Token sampling for the torch backend: temperature, top-k, top-p, seeded draws, sampled-token logprobs.

Logprob convention (rl_core.logprobs): the reported logprob of a sampled token is
log_softmax(logits / T)[token] in float32 over the FULL vocabulary, whatever top-k / top-p did to the
sampling distribution, because that is what a trainer recomputes from the same weights. Greedy decoding
(T = 0) reports the logprobs at T = 1.

Draws use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1)), which picks token i
with probability p_i. E comes either from a seeded `torch.Generator` (one random tensor per step for the
whole batch: the dense decode path) or from a counter-based hash of (row key, step, token id)
(`counter_exponential`: the paged path), so that a row's draws do not depend on which other rows share
its batch: continuous batching then changes nothing but speed, and the draw is graph-capturable.
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


_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser (a bijection with full avalanche) on int64 tensors holding 32-bit values.

    Products stay below 2**63 (32-bit value x 32-bit constant), so int64 arithmetic never overflows.
    """
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def row_keys(seed: int, rows: Tensor) -> Tensor:
    """32-bit sampling keys (int64) of global row ids `rows` for a request seed."""
    return _fmix32((_fmix32(torch.full_like(rows, int(seed) & _MASK32)) + rows * 0x9E3779B1) & _MASK32)


def counter_exponential(keys_B: Tensor, steps_B: Tensor, vocab: int) -> Tensor:
    """Exp(1) noise (B, V) float32 that is a pure function of (key, step, token id) per row."""
    row_step = _fmix32((keys_B + steps_B * 0x632BE5AB) & _MASK32)  # (B,)
    token = torch.arange(vocab, device=keys_B.device, dtype=torch.int64) * 0x85157AF5
    bits = _fmix32((row_step[:, None] ^ token[None, :]) & _MASK32) >> 8  # (B, V): 24 uniform bits
    uniform = (bits.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1): log never sees 0
    return -torch.log(uniform)


def sample_next(
    logits_BV: Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
    keys_B: Tensor | None = None, steps_B: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Next token ids (B,) and their float32 logprobs (B,) from last-position logits (B, V).

    The noise comes from `generator`, or from `counter_exponential(keys_B, steps_B)` when keys are given.
    """
    logits = logits_BV.float()
    if params.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprobs(logits, tokens)
    scaled = logits / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    if keys_B is not None:
        race = counter_exponential(keys_B, steps_B, scaled.shape[-1])
    else:
        race = torch.empty_like(scaled).exponential_(generator=generator)
    # argmax(p / E) == argmax(log p - log E), and log p differs from `filtered` by a per-row constant:
    # no softmax over the vocabulary is needed to draw.
    tokens = (filtered - race.log()).argmax(dim=-1)
    return tokens, _token_logprobs(scaled, tokens)


def _token_logprobs(logits_BV: Tensor, tokens_B: Tensor) -> Tensor:
    """log_softmax(logits)[token] per row without materialising the (B, V) log-softmax."""
    return logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1) - torch.logsumexp(logits_BV, dim=-1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator seeded with `seed`, or from fresh entropy when seed is None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen
