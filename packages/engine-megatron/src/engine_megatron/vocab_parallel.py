"""Target-token logprobs and entropy from megatron's vocab-parallel logits, without gathering the vocabulary.

Under TP each rank holds logits for a slice of the (padded) vocabulary, `(..., V/TP)`; megatron pads the
vocabulary to a multiple of `make_vocab_size_divisible_by * TP`, and the padded columns are not tokens
(each would add exp(logit) to the normaliser and shift every logprob). The math is rl-core's
`vocab_parallel_logprobs` (shared with engine-dtensor: one pass per token chunk, padded columns
ignored); this module supplies megatron's TP group and this rank's vocabulary offset.
"""

from __future__ import annotations

from torch import Tensor

from rl_core.logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS
from rl_core.logprobs import vocab_parallel_logprobs as _logprobs


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, vocab_size: int, temperature: float = 1.0,
                            chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS, *, with_entropy: bool = False,
                            top_k: int = 0, top_p: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """log softmax(logits / T)[targets] (with grad) and optionally the entropy (no grad) over the real
    vocabulary (or its top-k / top-p truncation), for vocab-parallel logits (..., V/TP) -> (...) float32 each."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    vocab_start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    return _logprobs(logits, targets, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
                     temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=with_entropy, top_k=top_k,
                     top_p=top_p)
