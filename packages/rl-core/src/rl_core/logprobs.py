"""The logprob convention shared by engines and rollout backends, and the engines' fused logprob kernel.

Logits are divided by the sampling temperature before the log-softmax, in float32, so that a trainer's
recomputed logprobs and a sampler's logprobs describe the same distribution. Results are aligned with
the tokens (rl_core.batch): position 0 gets 0.

`vocab_parallel_logprobs` is the one implementation of both engines: target logprobs (with grad) and,
optionally, the entropy (a metric, no grad) from one pass over each chunk of logits, the vocabulary
sharded over a process group (TP) or whole (`group=None`), padded vocabulary columns ignored.

Memory and traffic: a float32 log-softmax over a 152k vocabulary costs 0.6 MB per token, and each
elementwise pass over it reads and writes that much again; on a GPU these passes, not the lm_head
matmul, are what the logprobs cost. Tokens go through `chunk_tokens` rows at a time, so no float32
intermediate exceeds chunk_tokens x vocab; a chunk keeps only its (model-dtype) logits and two floats per
token for backward, which rebuilds the softmax from them: no second forward pass, no collective in
backward. Entropy shares the forward's max, exp and normaliser instead of a pass of its own.
"""

from __future__ import annotations

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


def all_reduce_in_group(x: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def vocab_parallel_logprobs(local_logits: Tensor, targets: Tensor, *, group: dist.ProcessGroup | None = None,
                            vocab_start: int = 0, vocab_size: int | None = None, temperature: float = 1.0,
                            chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
                            with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[target] (with grad) and, if asked, the entropy (no grad), both (...) float32.

    `local_logits` (..., V_local) are this rank's columns [vocab_start, vocab_start + V_local) of the
    vocabulary (all of it with `group=None`); columns at or past `vocab_size` are padding (megatron pads
    the vocabulary) and get probability 0. `targets` (...) are global token ids. Every rank of `group`
    must hold the same tokens: the chunks' collectives pair up.
    """
    if chunk_tokens < 1:
        raise ValueError(f"policy.logprob_chunk_tokens must be >= 1; got {chunk_tokens}")
    width = local_logits.shape[-1]
    real = width if vocab_size is None else min(max(vocab_size - vocab_start, 0), width)
    shape = local_logits.shape[:-1]
    logprobs, entropy = _VocabLogProb.apply(local_logits.reshape(-1, width), targets.reshape(-1), vocab_start, real,
                                            group, temperature, with_entropy, chunk_tokens)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None


class _VocabLogProb(torch.autograd.Function):
    """rows (N, V_local) -> target logprobs (N,) and entropy (N,) (empty unless asked for), `chunk` rows at a
    time.

    Built on torch's fused softmax kernels (one read of the chunk, one float32 write each), which see only
    this rank's columns; under TP the local results are corrected by per-row scalars: with lse_r the
    local log-normaliser and lse the global one, s = lse_r - lse, the global log-softmax is the local one
    + s, the softmax the local one * e^s, and the entropy sum_r e^s_r (H_r - s_r), H_r the local entropy.
    Saves the logits (no copy), the target index and s; backward recomputes each chunk's softmax,
    d lp / d logit_j = (1[j == target] - softmax_j) / T, straight into one gradient tensor of the logits'
    dtype (per-chunk gradients joined by a concatenation would hold the logits' size twice).
    """

    @staticmethod
    def forward(ctx, rows: Tensor, targets: Tensor, vocab_start: int, real: int,  # noqa: ANN001
                group: dist.ProcessGroup | None, temperature: float, with_entropy: bool,
                chunk: int) -> tuple[Tensor, Tensor]:
        local_target = targets - vocab_start
        in_shard = (local_target >= 0) & (local_target < real)
        index = local_target.clamp(0, max(real - 1, 0)).unsqueeze(-1)
        parts = [_chunk_forward(rows[i:i + chunk], index[i:i + chunk], in_shard[i:i + chunk], real, group,
                                temperature, with_entropy) for i in range(0, rows.shape[0], chunk)]
        target, entropy, shift = (torch.cat(column) for column in zip(*parts))
        ctx.save_for_backward(rows, index, in_shard, shift)
        ctx.real, ctx.temperature, ctx.chunk, ctx.tensor_parallel = real, temperature, chunk, group is not None
        entropy = entropy if with_entropy else entropy.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return target, entropy

    @staticmethod
    def backward(ctx, grad_logprob: Tensor, grad_entropy: Tensor):  # noqa: ANN205
        rows, index, in_shard, shift = ctx.saved_tensors
        real, temperature, chunk = ctx.real, ctx.temperature, ctx.chunk
        # padded columns: probability 0, gradient 0
        grad = torch.empty_like(rows) if real == rows.shape[-1] else torch.zeros_like(rows)
        for i in range(0, rows.shape[0] if real else 0, chunk):
            rows_i = slice(i, i + chunk)
            probs = torch.softmax(_scaled(rows[rows_i], real, temperature), -1, dtype=torch.float32)
            if ctx.tensor_parallel:
                probs.mul_(shift[rows_i].exp().unsqueeze(-1))  # the local softmax -> the global one
            # softmax - onehot before scaling: p_t - 1 is exact in float32 where p_t is near 1
            probs.scatter_add_(-1, index[rows_i], -in_shard[rows_i].unsqueeze(-1).to(probs.dtype))
            probs.mul_((grad_logprob[rows_i] / -temperature).unsqueeze(-1))
            grad[rows_i, :real].copy_(probs)  # to the logits' dtype in the same pass
            del probs  # before the next chunk's softmax exists
        return grad, None, None, None, None, None, None, None


def _chunk_forward(rows: Tensor, index: Tensor, in_shard: Tensor, real: int, group: dist.ProcessGroup | None,
                   temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(target logprobs, entropies (zeros unless asked for), shifts s) of one chunk, each (n,) float32."""
    shift = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)  # s = lse_r - lse: 0 without TP
    target = entropy = shift
    if real:
        x = _scaled(rows, real, temperature)
        logp = torch.log_softmax(x, -1, dtype=torch.float32)  # this rank's columns only
        if group is not None:
            # lse_r = x_j - logp_j at the row's largest logit, where logp_j is near 0: no cancellation
            row_max, argmax = x.max(-1, keepdim=True)
            local_lse = row_max.squeeze(-1).float() - logp.gather(-1, argmax).squeeze(-1)
            shift = _shift_to_global(local_lse, group)
        target = (logp.gather(-1, index).squeeze(-1) + shift) * in_shard
        if with_entropy:
            local_entropy = torch.special.entr(logp.exp_()).sum(-1)  # -sum p log p of the local softmax
            entropy = shift.exp() * (local_entropy - shift) if group is not None else local_entropy
    elif group is not None:  # every column of this rank is padding: it contributes nothing
        shift = torch.full_like(shift, float("-inf"))
        _shift_to_global(shift, group)  # the collectives the other ranks run
    if group is not None:
        target, entropy = all_reduce_in_group(torch.stack([target, entropy]), dist.ReduceOp.SUM, group)
    return target, entropy, shift


def _scaled(rows: Tensor, real: int, temperature: float) -> Tensor:
    """The real columns of `rows` / T: the rows themselves at T = 1 (the softmax kernels upcast)."""
    x = rows[:, :real]
    return x if temperature == 1.0 else x.to(torch.float32, copy=True).div_(temperature)


def _shift_to_global(local_lse: Tensor, group: dist.ProcessGroup) -> Tensor:
    """s = lse_r - log sum_r exp(lse_r) per row, over the ranks of `group`.

    Computed as (lse_r - max_r lse_r) - log sum_r exp(lse_r - max): exact 0 minus a small log on the rank
    with the largest normaliser, instead of the difference of two large log-normalisers."""
    relative = local_lse - all_reduce_in_group(local_lse.clone(), dist.ReduceOp.MAX, group)
    return relative - all_reduce_in_group(relative.exp(), dist.ReduceOp.SUM, group).log()
