"""The clipped policy-gradient loss of GRPO/PPO, with KL to a reference policy and IS correction.

Per token, with r = exp(logprobs - prev_logprobs) (GSPO: the sequence's exp(mean log-ratio)):
    pg = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))
    dual clip (A < 0 only): pg = min(pg, -A * c)
    token loss = is_weight * pg + kl_coef * KL(policy || ref)
Aggregation over the *global* batch (N_tok valid tokens, N_seq valid sequences, all DP ranks):
    "token-mean"           sum_t loss_t / N_tok
    "seq-mean-token-mean"  sum_s mean_{t in s} loss_t / N_seq
    "seq-mean-token-sum"   sum_s sum_{t in s} loss_t / N_seq   (Dr.GRPO, no length normalisation)
Because the normalisers are global, the losses of any split into micro-batches and ranks add up to the
full-batch loss. All tensors are flat per-token (T,) of one micro-batch.

Numerics: masked tokens are replaced by 0 (`torch.where`) before anything is exponentiated, and the
log-ratio is clamped to +-20 (rl_core.importance.LOG_RATIO_CLAMP) before `exp`, so neither a -inf on a
prompt token nor a log-ratio past float32's exp overflow (88.7) makes the loss or its gradient NaN.
A non-finite trainer logprob (current, prev or ref) on a *valid* token is counted
(`nonfinite_logprob_tokens`) and makes the loss NaN on purpose: the engines' optimizer_step skips a
step whose grad norm is not finite (metric `skipped`), so such a batch is never applied, on every DP
rank alike (the NaN reaches all of them through the gradient all-reduce).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rl_core.batch import LossInputs
from rl_core.config import Aggregation, KLKind, LossConfig
from rl_core.importance import importance_weights, masked_log_ratio
from rl_core.kl import kl_penalty
from rl_core.segments import segment_mean, segment_sum


def aggregate(
    token_loss: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    agg: Aggregation,
    num_valid_tokens: float,
    num_valid_seqs: float,
) -> Tensor:
    """Reduce a per-token loss (T,) to this micro-batch's share of the global-batch loss."""
    if agg == "token-mean":
        return (token_loss * mask).sum() / max(num_valid_tokens, 1.0)
    if agg == "seq-mean-token-mean":
        return segment_mean(token_loss, mask, seq_ids).sum() / max(num_valid_seqs, 1.0)
    if agg == "seq-mean-token-sum":
        return segment_sum(token_loss * mask, seq_ids).sum() / max(num_valid_seqs, 1.0)
    raise ValueError(f"loss aggregation {agg!r} is not known; choose one of {list(Aggregation.__args__)}")


def _masked_extreme(values: Tensor, mask: Tensor, largest: bool) -> Tensor:
    fill = float("-inf") if largest else float("inf")
    masked = torch.where(mask > 0, values, torch.full_like(values, fill))
    if masked.numel() == 0:
        return values.new_tensor(fill)
    return masked.max() if largest else masked.min()


def clipped_pg_loss(
    logprobs: Tensor,
    prev_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    num_valid_tokens: float,
    num_valid_seqs: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    agg: Aggregation = "token-mean",
    is_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k3",
    kl_input_clamp: float | None = 20.0,
    kl_output_clamp: float | None = 10.0,
    sequence_level_ratio: bool = False,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Micro-batch loss (scalar) and metrics, each already divided by the global normalisers."""
    mask = mask.to(logprobs.dtype)
    valid = mask > 0
    nonfinite = _count_nonfinite(valid, logprobs, prev_logprobs, ref_logprobs)
    log_ratio = masked_log_ratio(logprobs, prev_logprobs, valid)
    if sequence_level_ratio:  # GSPO: one ratio per sequence, geometric mean of the token ratios
        log_ratio = segment_mean(log_ratio, mask, seq_ids)[seq_ids]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.maximum(unclipped, clipped)
    # per-token means of no token are undefined (NaN, logged as null), not 0: a ratio_mean of 0 reads as a collapse
    n_tok = num_valid_tokens if num_valid_tokens > 0 else math.nan
    metrics: dict[str, Tensor] = {}
    if dual_clip is not None:
        dual = -advantages * dual_clip
        dual_active = (advantages < 0) & (pg > dual)
        pg = torch.where(advantages < 0, torch.minimum(pg, dual), pg)
        metrics["dual_clip_fraction"] = (dual_active.to(mask.dtype) * mask).sum().detach() / n_tok
    if is_weights is not None:
        pg = pg * is_weights.detach()
    pg_loss = aggregate(pg, mask, seq_ids, agg, num_valid_tokens, num_valid_seqs)
    loss = pg_loss
    if ref_logprobs is not None:  # masked tokens: logr = 0 - 0, so no -inf reaches the estimator's exp
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
        ref_logprobs = torch.where(valid, ref_logprobs, torch.zeros_like(ref_logprobs))
    if ref_logprobs is not None and kl_coef != 0.0:
        kl = kl_penalty(logprobs, ref_logprobs, kl_kind, kl_input_clamp, kl_output_clamp)
        kl_loss = aggregate(kl, mask, seq_ids, agg, num_valid_tokens, num_valid_seqs)
        loss = loss + kl_coef * kl_loss
        metrics["kl"] = (kl * mask).sum().detach() / n_tok
    elif ref_logprobs is not None:  # report the KL even when it is not penalised
        kl = kl_penalty(logprobs.detach(), ref_logprobs, kl_kind, kl_input_clamp, kl_output_clamp)
        metrics["kl"] = (kl * mask).sum() / n_tok
    with torch.no_grad():
        metrics["pg_loss"] = pg_loss.detach()
        metrics["clip_fraction"] = ((clipped > unclipped).to(mask.dtype) * mask).sum() / n_tok
        metrics["ratio_mean"] = (ratio * mask).sum() / n_tok
        metrics["ratio_min"] = _masked_extreme(ratio.detach(), mask, largest=False)
        metrics["ratio_max"] = _masked_extreme(ratio.detach(), mask, largest=True)
        metrics["advantages_mean"] = (advantages * mask).sum() / n_tok
        if entropy is not None:
            metrics["entropy"] = torch.where(valid, entropy.detach(), 0.0).sum() / n_tok
        metrics["nonfinite_logprob_tokens"] = nonfinite.to(mask.dtype)
        metrics["loss_tokens"] = mask.sum()
    return _poison_gradient(loss, logprobs, valid, nonfinite), metrics


def _poison_gradient(loss: Tensor, logprobs: Tensor, valid: Tensor, nonfinite: Tensor) -> Tensor:
    """`loss`, made NaN in value and in the gradient of every valid token when `nonfinite` > 0, so that
    optimizer_step skips the step (module docstring); unchanged otherwise. No host sync.

    Added as `NaN * sum(valid logprobs)` rather than multiplied into the loss: the NaN gradient of
    `loss * NaN` stops at every clamp, max or where that routed a token's gradient elsewhere, so a
    micro-batch whose valid tokens are all clipped gave a NaN loss with a finite gradient, and the step ran.
    """
    poison = torch.where(nonfinite > 0, float("nan"), 0.0).to(loss.dtype)
    anchor = torch.where(valid, logprobs, torch.zeros_like(logprobs)).sum()  # finite unless poisoned
    return loss + poison * anchor


def _count_nonfinite(valid: Tensor, *logprobs: Tensor | None) -> Tensor:
    """Valid tokens where any of the given logprobs is inf or NaN."""
    bad = torch.zeros_like(valid)
    for lp in logprobs:
        if lp is not None:
            bad |= ~torch.isfinite(lp.detach())
    return (bad & valid).sum()


class ClippedPGLoss:
    """The configured GRPO loss as an engine `LossFn`: `loss, metrics = loss_fn(inputs)`.

    Without `prev_logprobs` the batch is taken to be on-policy (one optimizer step per batch, the
    weights that train on it are the ones it is scored under): prev = the training forward's own
    logprobs, detached, so r = 1 exactly and no separate logprob pass is needed (as verl does when
    there is one mini-batch and one epoch). The caller must only leave it out in that case.
    """

    def __init__(self, cfg: LossConfig | None = None) -> None:
        self.cfg = cfg or LossConfig()

    def __call__(self, inputs: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        if inputs.advantages is None:
            raise ValueError("ClippedPGLoss needs TokenBatch.advantages")
        prev = inputs.logprobs.detach() if inputs.prev_logprobs is None else inputs.prev_logprobs
        metrics: dict[str, Tensor] = {}
        is_weights = None
        if inputs.gen_logprobs is not None:
            weights, is_metrics = importance_weights(
                prev,
                inputs.gen_logprobs,
                inputs.mask,
                inputs.seq_ids,
                level=cfg.importance.level,
                mode=cfg.importance.mode,
                low=cfg.importance.low,
                high=cfg.importance.high,
                num_valid_tokens=inputs.num_valid_tokens,
            )
            metrics.update(is_metrics)
            if cfg.importance.enabled:
                is_weights = weights
        loss, pg_metrics = clipped_pg_loss(
            inputs.logprobs,
            prev,
            inputs.advantages,
            inputs.mask,
            inputs.seq_ids,
            num_valid_tokens=inputs.num_valid_tokens,
            num_valid_seqs=inputs.num_valid_seqs,
            eps_low=cfg.eps_low,
            eps_high=cfg.eps_high,
            dual_clip=cfg.dual_clip,
            agg=cfg.agg,
            is_weights=is_weights,
            ref_logprobs=inputs.ref_logprobs,
            kl_coef=cfg.kl_coef,
            kl_kind=cfg.kl_kind,
            kl_input_clamp=cfg.kl_input_clamp,
            kl_output_clamp=cfg.kl_output_clamp,
            sequence_level_ratio=cfg.sequence_level_ratio,
            entropy=inputs.entropy,
        )
        metrics.update(pg_metrics)
        return loss, metrics
