"""Target-token log-probabilities and entropy from vocabulary-sharded logits.

Under tensor parallelism the `lm_head` is column-parallel, so each TP rank holds logits for one
contiguous slice of the vocabulary. The log-softmax of the target tokens needs only three all-reduces
over the TP group (max, sum of exp, target logit); the full `[tokens, vocab]` tensor is never
gathered. The backward is purely local: d lp / d logit_j = 1[j == target] - softmax_j.
With `group=None` (TP = 1) the same math runs without collectives, so there is one code path.
Tokens go through in chunks (rl_core.logprobs.chunked_over_tokens: fp32 intermediates bounded by
`chunk_tokens` x V_local, backward recomputes one chunk at a time); the entropy is rl_core's.

Does not own the alignment of logprobs with tokens (engine forward code does, with
rl_core.logprobs.shift_align).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rl_core.logprobs import (
    DEFAULT_LOGPROB_CHUNK_TOKENS,
    all_reduce_in_group,
    chunked_over_tokens,
    scaled_float_logits,
    vocab_parallel_entropy,
)

__all__ = ["vocab_parallel_entropy", "vocab_parallel_logprobs"]


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: Tensor, target: Tensor, vocab_start: int, group, temperature: float) -> Tensor:  # noqa: ANN001
        x = scaled_float_logits(local_logits, temperature)  # (N, V_local)
        max_logit = all_reduce_in_group(x.max(-1).values, dist.ReduceOp.MAX, group)  # (N,)
        x = x - max_logit.unsqueeze(-1)
        exp = x.exp()
        sum_exp = all_reduce_in_group(exp.sum(-1), dist.ReduceOp.SUM, group)  # (N,)
        vocab_local = x.shape[-1]
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < vocab_local)
        local_target = local_target.clamp(0, vocab_local - 1)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        target_logit = all_reduce_in_group(target_logit, dist.ReduceOp.SUM, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # reuse the buffer: (N, V_local)
        ctx.save_for_backward(softmax, local_target, in_shard)
        ctx.input_dtype = local_logits.dtype
        ctx.temperature = temperature
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        softmax, local_target, in_shard = ctx.saved_tensors
        grad = softmax.mul_(-grad_out.unsqueeze(-1))  # saved buffer is not used again
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (grad_out * in_shard).unsqueeze(-1))
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs(
    local_logits: Tensor,
    targets: Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor:
    """log softmax(logits / T)[target] for logits (..., V_local) of vocab slice [vocab_start, +V_local)."""

    def logprob(rows: Tensor, row_targets: Tensor) -> Tensor:
        return _VocabParallelLogProb.apply(rows, row_targets, vocab_start, group, temperature)

    return chunked_over_tokens(logprob, local_logits, targets, chunk_tokens=chunk_tokens)
