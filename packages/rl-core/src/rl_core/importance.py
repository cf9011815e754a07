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
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from rl_core.segments import segment_mean, segment_sum

ISLevel = Literal["token", "sequence"]
ISMode = Literal["tis", "icepop", "seq-mask-tis"] | None
IS_MODES = (None, "tis", "icepop", "seq-mask-tis")


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
    log_w = (prev - gen) * mask
    if level == "sequence":
        log_w = segment_sum(log_w, seq_ids)[seq_ids]
    raw = torch.exp(log_w)
    if mode is None:
        weights, out_of_bounds = raw, torch.zeros_like(raw, dtype=torch.bool)
    elif mode == "tis":
        weights, out_of_bounds = raw.clamp(low, high), (raw < low) | (raw > high)
    elif mode == "icepop":
        out_of_bounds = (raw < low) | (raw > high)
        weights = torch.where(out_of_bounds, torch.zeros_like(raw), raw)
    else:  # seq-mask-tis
        seq_ratio = torch.exp(segment_mean(prev - gen, mask, seq_ids))[seq_ids]
        out_of_bounds = (seq_ratio < low) | (seq_ratio > high)
        weights = torch.where(out_of_bounds, torch.zeros_like(raw), torch.exp(prev - gen).clamp(max=high))
    weights = weights * mask
    denom = float(num_valid_tokens) if num_valid_tokens is not None else mask.sum().clamp(min=1)
    metrics = {
        "token_mult_prob_error": (torch.exp((gen - prev).abs()) * mask).sum() / denom,
        "gen_kl": ((gen - prev) * mask).sum() / denom,
        "is_oob_fraction": (out_of_bounds.to(mask.dtype) * mask).sum() / denom,
        "is_weight_mean": weights.sum() / denom,
        "is_weight_max": weights.max() if weights.numel() else weights.new_zeros(()),
    }
    return weights, metrics
