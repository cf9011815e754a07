"""The logprob convention shared by engines and rollout backends, and the token-chunked computation.

Logits are divided by the sampling temperature before the log-softmax, in float32, so that a trainer's
recomputed logprobs and a sampler's logprobs describe the same distribution. Results are aligned with
the tokens (rl_core.batch): position 0 gets 0.

Memory: a float32 log-softmax over a 152k vocabulary costs 0.6 MB per token, and every intermediate
(the fp32 copy, exp, softmax) is that size again. `chunked_over_tokens` runs a per-token statistic on
`chunk_tokens` rows of the logits at a time and recomputes each chunk in backward, so no fp32
intermediate exceeds chunk_tokens x vocab and backward holds one chunk's softmax at a time instead of
every chunk's. The engines' logits themselves (model dtype) are not chunked here.

`vocab_parallel_entropy` is the one entropy implementation of both engines: vocabulary sharded over a
process group (TP) or whole (`group=None`), padded vocabulary columns masked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

# 1536 tokens x 151936 (Qwen2.5's vocabulary) x 4 bytes = 0.87 GiB per float32 intermediate.
DEFAULT_LOGPROB_CHUNK_TOKENS = 1536


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


def chunked_over_tokens(fn: Callable[..., Tensor], logits: Tensor, *per_token: Tensor,
                        chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS) -> Tensor:
    """`fn(logits_rows, *per_token_rows) -> (rows,)` over logits (..., V) in chunks of `chunk_tokens` rows.

    Returns (...) like the leading shape of `logits`. With grad enabled each chunk is recomputed in
    backward: forward keeps only the chunk's inputs (views of `logits`). `split`, not slicing: its
    backward is one concatenation instead of a zero-filled full-size tensor per chunk. `fn` may run
    collectives (TP): every rank of the group must hold the same number of tokens.
    """
    if chunk_tokens < 1:
        raise ValueError(f"policy.logprob_chunk_tokens must be >= 1; got {chunk_tokens}")
    shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    others = [t.reshape(-1) for t in per_token]
    if rows.shape[0] <= chunk_tokens:
        return fn(rows, *others).view(shape)
    grad = torch.is_grad_enabled() and logits.requires_grad
    outs = []
    for chunk in zip(rows.split(chunk_tokens), *(t.split(chunk_tokens) for t in others)):
        outs.append(_RecomputedChunk.apply(fn, *chunk) if grad else fn(*chunk))
    return torch.cat(outs).view(shape)


class _RecomputedChunk(torch.autograd.Function):
    """fn(rows, *others) without saving its intermediates; backward runs it again for the gradient.
    (torch.utils.checkpoint does the same but imports torch._dynamo on first use: seconds per process.)"""

    @staticmethod
    def forward(ctx, fn: Callable[..., Tensor], rows: Tensor, *others: Tensor) -> Tensor:  # noqa: ANN001
        ctx.fn = fn
        ctx.save_for_backward(rows, *others)
        return fn(rows, *others)  # autograd is off inside forward: nothing of fn is kept

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: ANN205
        rows, *others = ctx.saved_tensors
        with torch.enable_grad():
            leaf = rows.detach().requires_grad_()
            (grad,) = torch.autograd.grad(ctx.fn(leaf, *others), leaf, grad_out)
        return None, grad, *([None] * len(others))


def all_reduce_in_group(x: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def scaled_float_logits(local_logits: Tensor, temperature: float = 1.0, vocab_start: int = 0,
                        vocab_size: int | None = None) -> Tensor:
    """float32 logits / T (a new tensor) with the columns at or past `vocab_size` (padding) at -inf."""
    x = local_logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        x.div_(temperature)
    end = vocab_start + x.shape[-1]
    if vocab_size is not None and end > vocab_size:
        x[..., max(vocab_size - vocab_start, 0):] = float("-inf")
    return x


@torch.no_grad()
def vocab_parallel_entropy(local_logits: Tensor, *, group: dist.ProcessGroup | None = None,
                           temperature: float = 1.0, vocab_start: int = 0, vocab_size: int | None = None,
                           chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS) -> Tensor:
    """Entropy of softmax(logits / T) over the (sharded) vocabulary, (..., V_local) -> (...) float32.

    A metric: no grad. `vocab_start` is this rank's first column, `vocab_size` the real vocabulary
    (columns past it are padding and get probability 0).
    """

    def entropy(rows: Tensor) -> Tensor:
        x = scaled_float_logits(rows, temperature, vocab_start, vocab_size)
        x.sub_(all_reduce_in_group(x.max(-1).values, dist.ReduceOp.MAX, group).unsqueeze(-1))
        exp = x.exp()  # exp(-inf) = 0 on padded columns
        # H = log Z - E_p[x]; padded columns contribute p = 0 (not 0 * -inf)
        sums = torch.stack([exp.sum(-1), (exp * x.nan_to_num_(neginf=0.0)).sum(-1)])
        sums = all_reduce_in_group(sums, dist.ReduceOp.SUM, group)
        return sums[0].log() - sums[1] / sums[0]

    return chunked_over_tokens(entropy, local_logits, chunk_tokens=chunk_tokens)

