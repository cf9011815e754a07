"""Target-token log-probabilities and entropy from vocabulary-sharded logits.

Under tensor parallelism the `lm_head` is column-parallel, so each TP rank holds logits for one
contiguous slice of the vocabulary. The log-softmax of the target tokens needs only three all-reduces
over the TP group (max, sum of exp, target logit); the full `[tokens, vocab]` tensor is never
gathered. The backward is purely local: d lp / d logit_j = 1[j == target] - softmax_j.
With `group=None` (TP = 1) the same math runs without collectives, so there is one code path.

Does not own the alignment of logprobs with tokens (engine forward code does, with
rl_core.logprobs.shift_align).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_reduce(x: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: Tensor, target: Tensor, vocab_start: int, group) -> Tensor:  # noqa: ANN001
        x = local_logits.float()  # (N, V_local)
        max_logit = _all_reduce(x.max(-1).values, dist.ReduceOp.MAX, group)  # (N,)
        x = x - max_logit.unsqueeze(-1)
        exp = x.exp()
        sum_exp = _all_reduce(exp.sum(-1), dist.ReduceOp.SUM, group)  # (N,)
        vocab_local = x.shape[-1]
        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < vocab_local)
        local_target = local_target.clamp(0, vocab_local - 1)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * in_shard
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # reuse the buffer: (N, V_local)
        ctx.save_for_backward(softmax, local_target, in_shard)
        ctx.input_dtype = local_logits.dtype
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        softmax, local_target, in_shard = ctx.saved_tensors
        grad = softmax.mul_(-grad_out.unsqueeze(-1))  # saved buffer is not used again
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (grad_out * in_shard).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_logprobs(
    local_logits: Tensor,
    targets: Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """log softmax(logits / T)[target] for logits (..., V_local) of vocab slice [vocab_start, +V_local)."""
    if temperature != 1.0:
        local_logits = local_logits / temperature
    shape = targets.shape
    out = _VocabParallelLogProb.apply(
        local_logits.reshape(-1, local_logits.shape[-1]), targets.reshape(-1), vocab_start, group
    )
    return out.view(shape)


@torch.no_grad()
def vocab_parallel_entropy(
    local_logits: Tensor, *, group: dist.ProcessGroup | None = None, temperature: float = 1.0
) -> Tensor:
    """Entropy of softmax(logits / T) over the sharded vocabulary, (..., V_local) -> (...) float32."""
    x = local_logits.float() / temperature
    x = x - _all_reduce(x.max(-1).values, dist.ReduceOp.MAX, group).unsqueeze(-1)
    exp = x.exp()
    sum_exp = _all_reduce(exp.sum(-1), dist.ReduceOp.SUM, group)
    sum_px = _all_reduce((exp * x).sum(-1), dist.ReduceOp.SUM, group)
    return sum_exp.log() - sum_px / sum_exp  # H = log Z - E_p[x]
