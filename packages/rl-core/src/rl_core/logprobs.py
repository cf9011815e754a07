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

from rl_core.config import DEFAULT_LOGPROB_CHUNK_TOKENS

# What a truncated-away logit becomes before the log-softmax: exp(_DROPPED - max) is exactly 0 in float32,
# and unlike -inf a row whose every local column is dropped (a TP rank) still has a finite log-normaliser.
_DROPPED = -1e30


# Top-p looks for its cut among each row's largest logits first: a trained model's few hundred most probable
# tokens hold any usual top_p, and a top-k of the row costs a fraction of the sort that the whole row needs
# (which is several times the logprob kernel itself). A row whose candidates hold less than top_p is sorted.
TOP_P_CANDIDATES = 1024


def truncation_cut(logits: Tensor, top_k: int = 0, top_p: float = 1.0, *,
                   candidates: int | None = TOP_P_CANDIDATES) -> Tensor:
    """Per row of `logits` (N, V), the smallest logit a top-k / top-p sampler keeps -> (N,) of the logits' dtype.

    The kept set is every logit >= the cut, so ties with the boundary stay (as HF's and vLLM's top-k; their
    top-p breaks such ties by sort position, which is not reproducible). Top-k first, then top-p over the
    renormalised top-k: the smallest set of most probable tokens whose mass reaches top_p (a token is kept
    while the mass of those above it is < top_p, so the largest logit always is). -inf where neither binds.
    `candidates`: how many of a row's largest logits top-p looks among before sorting the rows they do not
    cover, which reads a value on the host; None sorts every row, with no host read (a CUDA graph captures
    the generator's sampling).
    """
    rows, vocab = logits.shape
    top_k_binds = 0 < top_k < vocab
    if top_p >= 1.0:
        return logits.topk(top_k, dim=-1).values[:, -1] if top_k_binds else logits.new_full((rows,), float("-inf"))
    if top_k_binds:  # top-p renormalises top-k's set: its candidates are the top-k (ties aside: see below)
        ordered = logits.topk(top_k, dim=-1).values
    elif candidates is None or candidates >= vocab:
        ordered = logits.sort(dim=-1, descending=True).values
    else:
        ordered = logits.topk(candidates, dim=-1).values  # descending
    cut = ordered[:, -1] if top_k_binds else logits.new_full((rows,), float("-inf"))
    # top-k's set with its ties, or the whole row: the distribution top-p renormalises
    lse = torch.logsumexp(logits.float().masked_fill(logits < cut[:, None], float("-inf")), dim=-1)
    nucleus_cut, held = _nucleus_cut(ordered, lse, top_p)
    # Top-k's candidates never fall short: when all are kept the cut is top-k's own, which keeps the ties.
    if not top_k_binds and ordered.shape[-1] < vocab:
        short = ~held
        if short.any():
            nucleus_cut[short] = _nucleus_cut(logits[short].sort(dim=-1, descending=True).values, lse[short],
                                              top_p)[0]
    return torch.maximum(cut, nucleus_cut)


def _nucleus_cut(ordered: Tensor, lse: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """(the last logit top-p keeps among a row's largest logits `ordered` (N, K), descending; whether they hold
    >= top_p of the mass, i.e. whether that is the row's cut) for the row normalisers `lse` (N,)."""
    probs = (ordered.float() - lse[:, None]).exp_()
    held = probs.cumsum(dim=-1)
    kept = (held - probs < top_p).sum(dim=-1, keepdim=True)  # >= 1: the first token has mass 0 before it
    return ordered.gather(-1, kept - 1).squeeze(-1), held[:, -1] >= top_p


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
                            chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS, with_entropy: bool = False,
                            top_k: int = 0, top_p: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[target] (with grad) and, if asked, the entropy (no grad), both (...) float32.

    `local_logits` (..., V_local) are this rank's columns [vocab_start, vocab_start + V_local) of the
    vocabulary (all of it with `group=None`); columns at or past `vocab_size` are padding (megatron pads
    the vocabulary) and get probability 0. `targets` (...) are global token ids. Every rank of `group`
    must hold the same tokens: the chunks' collectives pair up. `top_k` (0: off) / `top_p` (1: off): the
    distribution the sampler truncated to (module docstring).
    """
    if chunk_tokens < 1:
        raise ValueError(f"policy.logprob_chunk_tokens must be >= 1; got {chunk_tokens}")
    if top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_k={top_k} / top_p={top_p}: expected top_k >= 0 (0 = off) and 0 < top_p <= 1 (1 = off)")
    width = local_logits.shape[-1]
    real = width if vocab_size is None else min(max(vocab_size - vocab_start, 0), width)
    shape = local_logits.shape[:-1]
    truncation = (top_k, top_p) if top_k > 0 or top_p < 1.0 else None
    logprobs, entropy = _VocabLogProb.apply(local_logits.reshape(-1, width), targets.reshape(-1), vocab_start, real,
                                            group, temperature, with_entropy, chunk_tokens, truncation)
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None


class _VocabLogProb(torch.autograd.Function):
    """rows (N, V_local) -> target logprobs (N,) and entropy (N,) (empty unless asked for), `chunk` rows at a
    time.

    Built on torch's fused softmax kernels (one read of the chunk, one float32 write each), which see only
    this rank's columns; under TP the local results are corrected by per-row scalars: with lse_r the
    local log-normaliser and lse the global one, s = lse_r - lse, the global log-softmax is the local one
    + s, the softmax the local one * e^s, and the entropy sum_r e^s_r (H_r - s_r), H_r the local entropy.
    Saves the logits (no copy), the target index and s (and the truncation cut); backward recomputes each
    chunk's softmax, d lp / d logit_j = (1[j == target] - softmax_j) / T (0 for a truncated-away column),
    straight into one gradient tensor of the logits' dtype (per-chunk gradients joined by a concatenation
    would hold the logits' size twice).
    """

    @staticmethod
    def forward(ctx, rows: Tensor, targets: Tensor, vocab_start: int, real: int,  # noqa: ANN001
                group: dist.ProcessGroup | None, temperature: float, with_entropy: bool,
                chunk: int, truncation: tuple[int, float] | None) -> tuple[Tensor, Tensor]:
        local_target = targets - vocab_start
        in_shard = (local_target >= 0) & (local_target < real)
        index = local_target.clamp(0, max(real - 1, 0)).unsqueeze(-1)
        parts = []
        for i in range(0, rows.shape[0], chunk):
            scaled = _scaled(rows[i:i + chunk], real, temperature)
            cut = None if truncation is None else _global_cut(scaled, group, *truncation)
            parts.append((*_chunk_forward(scaled, index[i:i + chunk], in_shard[i:i + chunk], cut, group,
                                          with_entropy), cut))
        target, entropy, shift, cut = zip(*parts)
        target, entropy, shift = torch.cat(target), torch.cat(entropy), torch.cat(shift)
        cut = None if truncation is None else torch.cat(cut)
        ctx.save_for_backward(rows, index, in_shard, shift, cut)
        ctx.real, ctx.temperature, ctx.chunk, ctx.tensor_parallel = real, temperature, chunk, group is not None
        entropy = entropy if with_entropy else entropy.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        return target, entropy

    @staticmethod
    def backward(ctx, grad_logprob: Tensor, grad_entropy: Tensor):  # noqa: ANN205
        rows, index, in_shard, shift, cut = ctx.saved_tensors
        real, temperature, chunk = ctx.real, ctx.temperature, ctx.chunk
        # padded columns: probability 0, gradient 0
        grad = torch.empty_like(rows) if real == rows.shape[-1] else torch.zeros_like(rows)
        for i in range(0, rows.shape[0] if real else 0, chunk):
            rows_i = slice(i, i + chunk)
            x = _scaled(rows[rows_i], real, temperature)
            if cut is not None:
                x = _truncate(x, cut[rows_i], index[rows_i], in_shard[rows_i])
            probs = torch.softmax(x, -1, dtype=torch.float32)
            del x
            if ctx.tensor_parallel:
                probs.mul_(shift[rows_i].exp().unsqueeze(-1))  # the local softmax -> the global one
            # softmax - onehot before scaling: p_t - 1 is exact in float32 where p_t is near 1
            probs.scatter_add_(-1, index[rows_i], -in_shard[rows_i].unsqueeze(-1).to(probs.dtype))
            probs.mul_((grad_logprob[rows_i] / -temperature).unsqueeze(-1))
            grad[rows_i, :real].copy_(probs)  # to the logits' dtype in the same pass
            del probs  # before the next chunk's softmax exists
        return grad, None, None, None, None, None, None, None, None


def _chunk_forward(x: Tensor, index: Tensor, in_shard: Tensor, cut: Tensor | None, group: dist.ProcessGroup | None,
                   with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(target logprobs, entropies (zeros unless asked for), shifts s) of one chunk of scaled logits x (n, real),
    each (n,) float32."""
    shift = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)  # s = lse_r - lse: 0 without TP
    target = entropy = shift
    if x.shape[-1]:
        if cut is not None:
            x = _truncate(x, cut, index, in_shard)
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


def _truncate(x: Tensor, cut: Tensor, index: Tensor, in_shard: Tensor) -> Tensor:
    """x with the logits below each row's cut set to _DROPPED, except the row's target (a new tensor: x may be
    a view of the saved logits)."""
    drop = x < cut.to(x.dtype)[:, None]
    drop.scatter_(-1, index, drop.gather(-1, index) & ~in_shard[:, None])
    return x.masked_fill(drop, _DROPPED)


def _global_cut(x: Tensor, group: dist.ProcessGroup | None, top_k: int, top_p: float) -> Tensor:
    """`truncation_cut` of the rows whose columns x (n, real) holds one rank's share of (all of, without TP).

    Top-k alone needs only each rank's k largest (the global k largest are among them); top-p needs the
    whole distribution, gathered a block of rows at a time so that the gathered rows and their sort stay
    within the chunk's own size."""
    if group is None:
        return _blockwise_cut(x, top_k, top_p, ranks=1)
    ranks = dist.get_world_size(group)
    if top_p == 1.0:
        candidates = _pad_columns(x.topk(min(top_k, x.shape[-1]), dim=-1).values, top_k)
        return truncation_cut(_all_gather_columns(candidates, group), top_k)
    width = all_reduce_in_group(torch.tensor([x.shape[-1]], device=x.device), dist.ReduceOp.MAX, group).item()
    return _blockwise_cut(_pad_columns(x, width), top_k, top_p, ranks=ranks, group=group)


def _blockwise_cut(x: Tensor, top_k: int, top_p: float, *, ranks: int,
                   group: dist.ProcessGroup | None = None) -> Tensor:
    # a full sort holds float32 values and int64 indices: 3x the rows it sorts, times the ranks gathered
    block = max(1, x.shape[0] // (3 * ranks)) if top_p < 1.0 else x.shape[0]
    cuts = []
    for i in range(0, x.shape[0], block):
        rows = x[i:i + block]
        cuts.append(truncation_cut(rows if group is None else _all_gather_columns(rows, group), top_k, top_p))
    return torch.cat(cuts) if cuts else x.new_empty(0)


def _pad_columns(x: Tensor, width: int) -> Tensor:
    """x (n, w <= width) in float32, widened with -inf columns (never kept): all_gather needs equal shapes and
    dtypes on every rank."""
    return torch.nn.functional.pad(x.float(), (0, width - x.shape[-1]), value=float("-inf"))


def _all_gather_columns(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """(n, w) on each rank -> (n, ranks x w): every rank's columns side by side (their order is irrelevant
    to a cut, which depends on the values alone)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _shift_to_global(local_lse: Tensor, group: dist.ProcessGroup) -> Tensor:
    """s = lse_r - log sum_r exp(lse_r) per row, over the ranks of `group`.

    Computed as (lse_r - max_r lse_r) - log sum_r exp(lse_r - max): exact 0 minus a small log on the rank
    with the largest normaliser, instead of the difference of two large log-normalisers."""
    relative = local_lse - all_reduce_in_group(local_lse.clone(), dist.ReduceOp.MAX, group)
    return relative - all_reduce_in_group(relative.exp(), dist.ReduceOp.SUM, group).log()
