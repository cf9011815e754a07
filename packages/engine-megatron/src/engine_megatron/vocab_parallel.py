"""Target-token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Under TP each rank holds logits for a slice of the (padded) vocabulary, `(..., V/TP)`. The log-softmax
needs only three all-reduces over the TP group of `(...)`-shaped tensors (max, sum of exp, the target's
logit), which megatron's `vocab_parallel_cross_entropy` does with a correct backward; we use it for the
logprobs. Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by * TP`: the padded
columns are not tokens, so they are masked to -inf before the softmax (else each adds exp(0) to the
normaliser and every logprob shifts). Tokens go through in chunks (rl_core.logprobs.chunked_over_tokens:
fp32 intermediates bounded by `chunk_tokens` x V/TP); the entropy is rl_core's.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rl_core.logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, chunked_over_tokens, scaled_float_logits
from rl_core.logprobs import vocab_parallel_entropy as _entropy


def _vocab_range(local_vocab: int) -> tuple[int, Any]:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    return ps.get_tensor_model_parallel_rank() * local_vocab, group


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_size: int, temperature: float = 1.0,
                            chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS) -> Tensor:
    """log softmax(logits / T)[targets] for vocab-parallel logits (..., V/TP) -> (...) float32, with grad."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    vocab_start, _ = _vocab_range(logits.shape[-1])

    def logprob(rows: Tensor, row_targets: Tensor) -> Tensor:
        # a new fp32 tensor: megatron's cross-entropy kernel works in place on its input; it wants
        # (seq, batch, vocab), any 3-D shape works
        scaled = scaled_float_logits(rows, temperature, vocab_start, vocab_size)
        return -vocab_parallel_cross_entropy(scaled[None], row_targets[None])[0]

    return chunked_over_tokens(logprob, logits, targets, chunk_tokens=chunk_tokens)


def vocab_parallel_entropy(logits: Tensor, vocab_size: int, temperature: float = 1.0,
                           chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS) -> Tensor:
    """Entropy of softmax(logits / T) over the full vocabulary, (...) float32, no grad (a metric)."""
    vocab_start, group = _vocab_range(logits.shape[-1])
    return _entropy(logits, group=group, temperature=temperature, vocab_start=vocab_start, vocab_size=vocab_size,
                    chunk_tokens=chunk_tokens)
