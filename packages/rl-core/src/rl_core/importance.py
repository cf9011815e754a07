"""Importance-sampling correction for the mismatch between the inference engine and the trainer.

Samples come from the rollout backend's policy (`gen_logprobs`) but the loss is taken under the
trainer's numerics (`prev_logprobs`, same weights). The weight is w = exp(prev - gen):
- level "token": per token; level "sequence": exp(sum over the sequence's valid tokens), broadcast.
- mode None: raw weights.  "tis": truncated to [low, high] (truncated IS).
  "icepop": weights outside [low, high] are set to 0 (masked IS).
  "seq-mask-tis": token weights truncated to `high`, and whole sequences whose geometric-mean ratio
  exp(mean log w) falls outside [low, high] get weight 0.
Metrics are sums divided by `num_valid_tokens` (the global count if given), so they add up over
micro-batches (rl_core.metrics).

Numerics: masked positions are replaced by 0 with `torch.where` before anything is exponentiated (a
prompt token's trainer logprob can be -90 or -inf while gen is 0 there: `exp(...) * mask` would be
inf * 0 = NaN), and every log-ratio is clamped to +-LOG_RATIO_CLAMP before `exp` (as verl does), so a
weight or `token_mult_prob_error` term is at most exp(20) ~ 4.9e8, never inf in float32 (exp overflows
there at 88.7). A NaN sampler logprob on a valid token gives weight 0 to what it enters (its token, or its
sequence at level "sequence" and in seq-mask-tis) and counts as out of bounds, in every mode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_core.config import ISLevel, ISMode
from rl_core.segments import segment_mean, segment_sum

IS_MODES = (None, "tis", "icepop", "seq-mask-tis")
LOG_RATIO_CLAMP = 20.0


def masked_log_ratio(numerator: Tensor, denominator: Tensor, valid: Tensor) -> Tensor:
    """`numerator - denominator` on valid tokens, 0 on masked ones, clamped to +-LOG_RATIO_CLAMP.

    `torch.where` rather than `* mask`: a -inf or NaN on a masked token must not reach the result
    (inf * 0 is NaN) nor its gradient (where's backward sends 0 to the branch it did not take).
    """
    diff = torch.where(valid, numerator - denominator, torch.zeros_like(numerator))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_weights(
    prev_logprobs: Tensor,
    gen_logprobs: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    level: ISLevel = "token",
    mode: ISMode = None,
    low: float = 0.0,
    high: float = 2.0,
    num_valid_tokens: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights (T,) (detached) and IS metrics."""
    if level not in ("token", "sequence"):
        raise ValueError(f"importance level {level!r} is not known; choose 'token' or 'sequence'")
    if mode not in IS_MODES:
        raise ValueError(f"importance mode {mode!r} is not known; choose one of {list(IS_MODES)}")
    if not low <= high:
        raise ValueError(f"importance bounds need low <= high; got low={low}, high={high}")
    prev, gen, mask = prev_logprobs.detach(), gen_logprobs.detach(), mask.detach().to(prev_logprobs.dtype)
    valid = mask > 0
    log_w = masked_log_ratio(prev, gen, valid)
    if level == "sequence":
        log_w = segment_sum(log_w, seq_ids)[seq_ids].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    raw = torch.exp(log_w)
    # a NaN sampler logprob leaves its weight unknown: weight 0 (not a NaN loss), counted out of bounds
    unknown = raw.isnan()
    if mode is None:
        weights, out_of_bounds = raw, unknown
    elif mode == "tis":
        weights, out_of_bounds = raw.clamp(low, high), (raw < low) | (raw > high) | unknown
    elif mode == "icepop":
        out_of_bounds = (raw < low) | (raw > high) | unknown
        weights = torch.where(out_of_bounds, torch.zeros_like(raw), raw)
    else:  # seq-mask-tis
        token_log_w = masked_log_ratio(prev, gen, valid)
        # the mean of unclamped differences: one -inf token must reject its sequence, not be clamped away
        seq_log_ratio = segment_mean(torch.where(valid, prev - gen, torch.zeros_like(prev)), mask, seq_ids)
        seq_ratio = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))[seq_ids]
        out_of_bounds = (seq_ratio < low) | (seq_ratio > high) | seq_log_ratio.isnan()[seq_ids]
        weights = torch.where(out_of_bounds, torch.zeros_like(raw), torch.exp(token_log_w).clamp(max=high))
    weights = torch.where(valid & ~unknown, weights, torch.zeros_like(weights))
    denom = float(num_valid_tokens) if num_valid_tokens is not None else mask.sum().clamp(min=1)
    # the mismatch of tokens whose sampler logprob is known (an unknown one counts as no mismatch: it shows in
    # is_oob_fraction, and a NaN here would blank the step's metric); clamped like the weights (a -inf is finite)
    gen_log_ratio = masked_log_ratio(gen, prev, valid & ~gen.isnan())
    metrics = {
        "token_mult_prob_error": torch.where(valid, torch.exp(gen_log_ratio.abs()), 0.0).sum() / denom,
        "gen_kl": gen_log_ratio.sum() / denom,
        "is_oob_fraction": (out_of_bounds.to(mask.dtype) * mask).sum() / denom,
        "is_weight_mean": weights.sum() / denom,
        "is_weight_max": weights.max() if weights.numel() else weights.new_zeros(()),
    }
    return weights, metrics
