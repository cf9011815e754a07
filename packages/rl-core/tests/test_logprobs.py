"""Token-chunked logprobs and entropy: equal to the unchunked float64 computation (values and grads),
and no float32 tokens x vocab intermediate beyond the chunk, forward or backward."""

from __future__ import annotations

import pytest
import torch

from rl_core.logprobs import chunked_over_tokens, scaled_float_logits, vocab_parallel_entropy
from rl_core.testing.memory import LargestTensors

QWEN_VOCAB = 151936


def _logprob(rows: torch.Tensor, targets: torch.Tensor, temperature: float = 0.7) -> torch.Tensor:
    logp = torch.log_softmax(scaled_float_logits(rows, temperature), -1)
    return logp.gather(-1, targets[:, None])[:, 0]


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None = None):
    """float64, whole tensor at once: logprobs, entropy, d sum(w * logprobs) / d logits."""
    x = logits.detach().double().requires_grad_()
    z = x / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(x.shape[-1]) >= vocab_size, float("-inf"))
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    probs = logp.exp()
    entropy = -(probs * logp.nan_to_num(neginf=0.0)).sum(-1)
    weights = torch.linspace(-1, 2, lp.numel(), dtype=torch.float64).view(lp.shape)
    (lp * weights).sum().backward()
    return lp, entropy, x.grad, weights


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_chunked_logprobs_entropy_and_grads_equal_the_unchunked_float64(chunk: int) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()  # (B, S, V), 21 tokens
    targets = torch.randint(0, 50, (3, 7))
    ref_lp, ref_entropy, ref_grad, weights = _reference(logits, targets, 0.7)
    lp = chunked_over_tokens(_logprob, logits, targets, chunk_tokens=chunk)
    (lp * weights.float()).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=0, atol=2e-6)
    entropy = vocab_parallel_entropy(logits.detach(), temperature=0.7, chunk_tokens=chunk)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)


def test_entropy_gives_padded_vocabulary_columns_probability_zero() -> None:
    torch.manual_seed(1)
    logits = torch.randn(9, 64)
    targets = torch.randint(0, 50, (9,))
    _, ref_entropy, _, _ = _reference(logits, targets, 1.3, vocab_size=50)
    # columns 40..63 on a second "rank" holding vocab [40, 64) of a 50-token vocabulary: only 40..49 count
    got = vocab_parallel_entropy(logits, temperature=1.3, vocab_size=50, chunk_tokens=4)
    torch.testing.assert_close(got.double(), ref_entropy, rtol=0, atol=5e-6)
    shard = scaled_float_logits(logits[:, 40:], 1.3, vocab_start=40, vocab_size=50)
    assert torch.isinf(shard[:, 10:]).all() and torch.isfinite(shard[:, :10]).all()


def test_no_fp32_intermediate_beyond_the_chunk_at_a_152k_vocabulary() -> None:
    """bf16 logits of 48 tokens x 151936 in, chunks of 8: every float32 tensor created in forward
    (logprobs + entropy) and backward stays within 8 x vocab (the unchunked version makes 48 x vocab)."""
    torch.manual_seed(2)
    tokens, chunk = 48, 8
    logits = torch.randn(tokens, QWEN_VOCAB, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, QWEN_VOCAB, (tokens,))
    with LargestTensors() as seen:
        lp = chunked_over_tokens(_logprob, logits, targets, chunk_tokens=chunk)
        vocab_parallel_entropy(logits.detach(), chunk_tokens=chunk)
        lp.sum().backward()
    assert seen.numel(torch.float32) <= chunk * QWEN_VOCAB, seen.largest
    chunked_grad, logits.grad = logits.grad, None
    with LargestTensors() as unchunked:  # the bound is not vacuous: the whole batch at once is bigger
        whole = chunked_over_tokens(_logprob, logits, targets, chunk_tokens=tokens)
        whole.sum().backward()
    assert unchunked.numel(torch.float32) == tokens * QWEN_VOCAB
    assert torch.equal(lp, whole)
    torch.testing.assert_close(chunked_grad, logits.grad, rtol=0, atol=0)


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 1"):
        chunked_over_tokens(_logprob, torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_tokens=0)
