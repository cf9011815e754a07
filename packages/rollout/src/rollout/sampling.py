"""Token sampling for the torch backend: temperature, top-k, top-p, seeded draws, sampled-token logprobs.

Logprob convention (rl_core.logprobs): the reported logprob of a sampled token is that of the distribution
it was drawn from, log_softmax(logits / T) in float32 over the tokens top-k / top-p keep (all of them when
neither is set), as vLLM reports it and as the engines recompute it with `policy.top_k` / `policy.top_p`.
The kept set is rl_core.logprobs.truncation_cut's, the engines' own. Greedy decoding (T = 0) reports the
logprobs at T = 1 over the full vocabulary.

Draws use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1)), which picks token i
with probability p_i. E comes either from a seeded `torch.Generator` (one random tensor per step for the
whole batch: the dense decode path) or from a counter-based hash of (row key, step, token id)
(`counter_exponential`: the paged path), so that a row's draws do not depend on which other rows share
its batch: continuous batching then changes nothing but speed, and the draw is graph-capturable.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import Tensor

from rl_core.config import MIN_TEMPERATURE
from rl_core.interfaces import SamplingParams
from rl_core.logprobs import truncation_cut

logger = logging.getLogger(__name__)


def validate_params(params: SamplingParams) -> None:
    """Raise ValueError naming the field for sampling parameters no backend can honour."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n={params.n}; expected >= 1 completions per prompt")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens}; expected >= 1")
    if not (params.temperature >= 0 and math.isfinite(params.temperature)):
        raise ValueError(f"SamplingParams.temperature={params.temperature}; expected a finite value >= 0 (0 = greedy)")
    if 0 < params.temperature < MIN_TEMPERATURE:  # logits / T overflow float32: NaN logprobs, or an index error
        raise ValueError(f"SamplingParams.temperature={params.temperature} is below {MIN_TEMPERATURE} (vLLM's greedy "
                         "threshold), where logits / temperature overflow float32; use 0 for greedy decoding")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p={params.top_p}; expected 0 < top_p <= 1 (1 disables it)")
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k={params.top_k}; expected >= 0 (0 disables it)")


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (the argmax always survives).

    As HF's warpers and vLLM: top-k keeps every logit tied with the k-th largest; top-p keeps, of the top-k
    tokens renormalised, the smallest set of most probable tokens holding >= top_p (and every logit tied
    with the last of them: rl_core.logprobs.truncation_cut, the engines' definition)."""
    if top_k <= 0 and top_p >= 1.0:
        return logits_BV
    cut = truncation_cut(logits_BV, top_k, top_p, candidates=None)  # no host read: CUDA graphs capture this
    return logits_BV.masked_fill(logits_BV < cut[:, None], float("-inf"))


_MASK32 = 0xFFFFFFFF
_FMIX_C1, _FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
_TOKEN_MUL = 0x85157AF5


def _fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser (a bijection with full avalanche) on int64 tensors holding 32-bit values.

    Products stay below 2**63 (32-bit value x 32-bit constant), so int64 arithmetic never overflows.
    """
    h = h ^ (h >> 16)
    h = (h * _FMIX_C1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _FMIX_C2) & _MASK32
    return h ^ (h >> 16)


def _signed32(value: int) -> int:
    """The int32 with the same 32 bits as the unsigned 32-bit `value`."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _fmix32_wrapping_(h: Tensor) -> Tensor:
    """`_fmix32` in place on int32 tensors whose multiplies wrap modulo 2**32 (same bits, half the bytes).

    Right shifts of int32 are arithmetic, so each shift is masked back to the bits a logical shift keeps.
    """
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    h.mul_(_signed32(_FMIX_C1))
    h.bitwise_xor_((h >> 13).bitwise_and_(0x7FFFF))
    h.mul_(_signed32(_FMIX_C2))
    return h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))


def _uniform_bits_int64(row_step_B: Tensor, vocab: int) -> Tensor:
    """24 uniform bits (B, V) of (row_step, token id) in int64 arithmetic (exact on every backend)."""
    token = (torch.arange(vocab, device=row_step_B.device, dtype=torch.int64) * _TOKEN_MUL) & _MASK32
    return _fmix32(row_step_B[:, None] ^ token[None, :]) >> 8


def _uniform_bits_int32(row_step_B: Tensor, vocab: int) -> Tensor:
    """The same bits as `_uniform_bits_int64` through wrapping int32 arithmetic: every (B, V) temporary is
    4 bytes a token instead of 8, and the hash runs in place."""
    token = torch.arange(vocab, device=row_step_B.device, dtype=torch.int32).mul_(_signed32(_TOKEN_MUL))
    row_step = torch.where(row_step_B >= 1 << 31, row_step_B - (1 << 32), row_step_B).to(torch.int32)
    bits = _fmix32_wrapping_(row_step[:, None] ^ token[None, :])
    return (bits >> 8).bitwise_and_(0xFFFFFF)


@functools.cache
def int32_hash_wraps(device: torch.device) -> bool:
    """Whether int32 multiplies wrap modulo 2**32 on `device` (checked once against the int64 hash).

    C++ leaves signed overflow undefined; CPU and CUDA kernels wrap in practice, but a backend that
    saturates or traps would silently change every draw, so the int64 hash stays the fallback.
    """
    edges = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x9E3779B1, 0x12345678], device=device)
    wraps = torch.equal(_uniform_bits_int32(edges, 70001).long(), _uniform_bits_int64(edges, 70001))
    if not wraps:
        logger.warning("int32 multiplies do not wrap on %s: keyed sampling noise uses int64 arithmetic", device)
    return wraps


def row_keys(seed: int, rows: Tensor) -> Tensor:
    """32-bit sampling keys (int64) of global row ids `rows` for a request seed."""
    return _fmix32((_fmix32(torch.full_like(rows, int(seed) & _MASK32)) + rows * 0x9E3779B1) & _MASK32)


def counter_exponential(keys_B: Tensor, steps_B: Tensor, vocab: int) -> Tensor:
    """Exp(1) noise (B, V) float32 that is a pure function of (key, step, token id) per row.

    Graph-capturable once `int32_hash_wraps(device)` has run outside the capture (its check syncs); the
    paged path samples each row's first token eagerly, which runs it.
    """
    row_step = _fmix32((keys_B + steps_B * 0x632BE5AB) & _MASK32)  # (B,)
    if int32_hash_wraps(keys_B.device):
        bits = _uniform_bits_int32(row_step, vocab)  # (B, V)
    else:
        bits = _uniform_bits_int64(row_step, vocab)
    uniform = bits.float().add_(0.5).mul_(1.0 / (1 << 24))  # in (0, 1]: float32 rounds 2**24 - 0.5 up to 2**24
    # u = 1 would give E = 0, whose token wins every race (and a filtered one gives -inf + inf = NaN, which
    # argmax picks): clamp to -log(1 - 2**-25), the E that unrounded top bit pattern stands for.
    return uniform.log_().neg_().clamp_(min=2.0**-25)


def sampling_key(params: SamplingParams) -> tuple[float, int, float]:
    """What a decode step's sampling depends on: (temperature, top_k, top_p); greedy ignores top-k/top-p."""
    if params.temperature == 0.0:
        return (0.0, 0, 1.0)
    return (float(params.temperature), int(params.top_k), float(params.top_p))


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
    scaled = logits if params.temperature == 1.0 else logits / params.temperature  # x / 1 == x: one pass fewer
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    if keys_B is not None:
        race = counter_exponential(keys_B, steps_B, scaled.shape[-1])
    else:
        race = torch.empty_like(scaled).exponential_(generator=generator)
    # argmax(p / E) == argmax(log p - log E), and log p differs from `filtered` by a per-row constant:
    # no softmax over the vocabulary is needed to draw. In place: no further (B, V) temporaries.
    tokens = race.log_().neg_().add_(filtered).argmax(dim=-1)
    return tokens, _token_logprobs(filtered, tokens)


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
