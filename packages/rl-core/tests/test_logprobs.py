"""The engines' fused logprob kernel: target logprobs, their gradient and the entropy equal the float64
log-softmax over the whole tensor at once, for any chunking, with padded vocabulary columns ignored; and no
float32 tokens x vocab intermediate beyond the chunk, forward or backward."""

from __future__ import annotations

import pytest
import torch

from rl_core.logprobs import vocab_parallel_logprobs
from rl_core.testing.memory import LargestTensors, PeakLiveTensors

QWEN_VOCAB = 151936


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
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_grads_equal_the_unchunked_float64(chunk: int, temperature: float) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 3).requires_grad_()  # (B, S, V), 21 tokens
    targets = torch.randint(0, 50, (3, 7))
    ref_lp, ref_entropy, ref_grad, weights = _reference(logits, targets, temperature)
    lp, entropy = vocab_parallel_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk,
                                          with_entropy=True)
    (lp * weights.float()).sum().backward()
    assert lp.shape == entropy.shape == (3, 7) and not entropy.requires_grad
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
    alone, no_entropy = vocab_parallel_logprobs(logits.detach(), targets, temperature=temperature,
                                                chunk_tokens=chunk)
    assert no_entropy is None and torch.equal(alone, lp.detach())


def test_padded_vocabulary_columns_get_probability_and_gradient_zero() -> None:
    """Columns past vocab_size (megatron's padding) hold huge logits that must not count, on a rank whose
    slice is partly padding and on one whose slice is all padding."""
    torch.manual_seed(1)
    logits = torch.randn(9, 64) * 2
    logits[:, 50:] = 40.0
    targets = torch.randint(0, 50, (9,))
    ref_lp, ref_entropy, ref_grad, weights = _reference(logits, targets, 1.3, vocab_size=50)
    for vocab_start, width in ((0, 64), (40, 24), (50, 14)):  # whole; [40, 64) of a 50-token vocabulary; padding only
        local = logits[:, vocab_start:vocab_start + width].clone().requires_grad_()
        lp, entropy = vocab_parallel_logprobs(local, targets, vocab_start=vocab_start, vocab_size=50,
                                              temperature=1.3, chunk_tokens=4, with_entropy=True)
        (lp * weights.float()).sum().backward()
        assert torch.isfinite(local.grad).all()
        if vocab_start == 0:  # one rank holds every real column: the full answer
            torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
            torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
        padding = local.grad[:, max(50 - vocab_start, 0):]
        assert padding.numel() and not padding.any()


def test_no_fp32_intermediate_beyond_the_chunk_at_a_152k_vocabulary() -> None:
    """bf16 logits of 48 tokens x 151936 in, chunks of 8: every float32 tensor created in forward
    (logprobs + entropy) and backward stays within 8 x vocab (the unchunked version makes 48 x vocab)."""
    torch.manual_seed(2)
    tokens, chunk = 48, 8
    logits = torch.randn(tokens, QWEN_VOCAB, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, QWEN_VOCAB, (tokens,))
    with LargestTensors() as seen:
        lp, _ = vocab_parallel_logprobs(logits, targets, chunk_tokens=chunk, with_entropy=True)
        lp.sum().backward()
    assert seen.numel(torch.float32) <= chunk * QWEN_VOCAB, seen.largest
    assert logits.grad.dtype == torch.bfloat16
    chunked_grad, logits.grad = logits.grad, None
    with LargestTensors() as unchunked:  # the bound is not vacuous: the whole batch at once is bigger
        whole, _ = vocab_parallel_logprobs(logits, targets, chunk_tokens=tokens)
        whole.sum().backward()
    assert unchunked.numel(torch.float32) == tokens * QWEN_VOCAB
    assert torch.equal(lp, whole)
    torch.testing.assert_close(chunked_grad, logits.grad, rtol=0, atol=0)


def test_backward_holds_one_gradient_of_the_logits_plus_a_chunk() -> None:
    """The gradient of bf16 logits (96 tokens x 151936) is written chunk by chunk into one tensor: at no time
    do the tensors the kernel creates hold more than that gradient and two float32 chunks (on the CPU
    torch's softmax makes a float32 copy of its bf16 input first). Per-chunk gradients joined by a
    concatenation (the previous design) held 2x the logits."""
    torch.manual_seed(3)
    tokens, chunk = 96, 8
    logits = torch.randn(tokens, QWEN_VOCAB, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, QWEN_VOCAB, (tokens,))
    with PeakLiveTensors(last_dim=QWEN_VOCAB) as live:
        lp, _ = vocab_parallel_logprobs(logits, targets, chunk_tokens=chunk, with_entropy=True)
        lp.sum().backward()
    bound = logits.untyped_storage().nbytes() + 2 * chunk * QWEN_VOCAB * 4
    assert logits.untyped_storage().nbytes() <= live.peak_bytes <= bound, (live.peak_bytes, bound)


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 1"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_tokens=0)
