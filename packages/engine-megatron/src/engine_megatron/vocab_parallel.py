"""Target-token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Under TP each rank holds logits for a slice of the (padded) vocabulary, `(..., V/TP)`. The log-softmax
needs only three all-reduces over the TP group of `(...)`-shaped tensors (max, sum of exp, the target's
logit), which megatron's `vocab_parallel_cross_entropy` does with a correct backward; we use it for the
logprobs. Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * TP`: the padded
columns are not tokens, so they are masked to -inf before the softmax (else each adds exp(0) to the
normaliser and every logprob shifts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _vocab_range(local_vocab: int) -> tuple[int, int, dist.ProcessGroup | None, int]:
    from megatron.core import parallel_state as ps

    rank = ps.get_tensor_model_parallel_rank()
    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    return rank * local_vocab, (rank + 1) * local_vocab, group, ps.get_tensor_model_parallel_world_size()


def _masked_scaled(logits: Tensor, vocab_size: int, temperature: float) -> Tensor:
    """float32 logits / T with the padded vocabulary columns of this rank at -inf."""
    start, end, _, _ = _vocab_range(logits.shape[-1])
    # A copy: megatron's cross-entropy kernel works in place on its input.
    logits = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        logits = logits / temperature
    if end > vocab_size:
        keep = torch.arange(start, end, device=logits.device) < vocab_size  # (V/TP,)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_size: int, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T)[targets] for vocab-parallel logits (..., V/TP) -> (...) float32, with grad."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = _masked_scaled(logits, vocab_size, temperature)
    # megatron's kernel wants (seq, batch, vocab); any leading shape works as long as it is 3-D.
    flat = scaled.reshape(1, -1, scaled.shape[-1])
    nll = vocab_parallel_cross_entropy(flat, targets.reshape(1, -1))
    return (-nll).reshape(targets.shape)


@torch.no_grad()
def vocab_parallel_entropy(logits: Tensor, vocab_size: int, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / T) over the full vocabulary, (...) float32, no grad (a metric)."""
    scaled = _masked_scaled(logits, vocab_size, temperature)
    _, _, group, tp = _vocab_range(logits.shape[-1])
    local_max = scaled.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - local_max.unsqueeze(-1)
    exp = shifted.exp()  # exp(-inf) = 0 on the padded columns
    # H = log Z - sum p * z, with z the shifted logits; padded columns contribute p = 0 (not 0 * -inf).
    sums = torch.stack([exp.sum(-1), (exp * shifted.nan_to_num(neginf=0.0)).sum(-1)])
    if tp > 1:
        dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]
