"""The engines' fused logprob kernel: target logprobs, their gradient and the entropy equal the float64
log-softmax over the whole tensor at once, for any chunking, with padded vocabulary columns ignored; and no
float32 tokens x vocab intermediate beyond the chunk, forward or backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rl_core.logprobs import truncation_cut, vocab_parallel_logprobs
from rl_core.testing.distributed import run_distributed
from rl_core.testing.memory import LargestTensors, PeakLiveTensors
from rl_core.testing.truncation import truncated_log_softmax

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


@pytest.mark.parametrize("top_k,top_p", [(50, 1.0), (0, 0.9), (50, 0.9)])
def test_truncation_stays_within_the_chunk_at_a_152k_vocabulary(top_k: int, top_p: float) -> None:
    """The cut's sort (float32 values, int64 indices) runs a third of a chunk at a time: no float32 tensor
    beyond chunk x vocab, forward or backward, and no int64 one beyond it either."""
    torch.manual_seed(7)
    tokens, chunk = 24, 12
    logits = torch.randn(tokens, QWEN_VOCAB, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, QWEN_VOCAB, (tokens,))
    with LargestTensors() as seen:
        lp, _ = vocab_parallel_logprobs(logits, targets, chunk_tokens=chunk, with_entropy=True, top_k=top_k,
                                        top_p=top_p)
        lp.sum().backward()
    assert seen.numel(torch.float32) <= chunk * QWEN_VOCAB, seen.largest
    assert seen.numel(torch.int64) <= chunk * QWEN_VOCAB // 3, seen.largest
    assert torch.isfinite(lp).all() and torch.isfinite(logits.grad).all()


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


def _truncated_reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float,
                         vocab_size: int | None = None):
    """float64, whole tensor at once, the kept set from rl_core.testing.truncation's pairwise definition (the
    target kept whatever). Returns as `_reference`, and the kept set."""
    real = logits.shape[-1] if vocab_size is None else vocab_size
    x = logits.detach().double().requires_grad_()
    logp = torch.full_like(x, float("-inf"))
    logp[:, :real] = truncated_log_softmax(x[:, :real] / temperature, top_k, top_p, targets)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
    weights = torch.linspace(-1, 2, lp.numel(), dtype=torch.float64)
    (lp * weights).sum().backward()
    return lp.detach(), entropy.detach(), x.grad, weights, torch.isfinite(logp)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (12, 0.6), (1, 1.0), (0, 1e-6), (60, 0.9)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_truncated_logprobs_entropy_and_grads_equal_the_float64_definition(top_k: int, top_p: float,
                                                                            temperature: float) -> None:
    """top-k / top-p: the distribution a truncating sampler draws from, renormalised over its kept tokens,
    for any chunking; truncated-away logits get gradient 0; a target the cut would drop is kept."""
    torch.manual_seed(4)
    logits = torch.randn(21, 50) * 3
    targets = torch.randint(0, 50, (21,))
    targets[0] = logits[0].argmin()  # below every cut above: kept all the same
    ref_lp, ref_entropy, ref_grad, weights, keep = _truncated_reference(logits, targets, temperature, top_k, top_p)
    assert (~keep).any() or top_k >= 50
    for chunk in (1, 4, 1000):
        local = logits.clone().requires_grad_()
        lp, entropy = vocab_parallel_logprobs(local, targets, temperature=temperature, chunk_tokens=chunk,
                                              with_entropy=True, top_k=top_k, top_p=top_p)
        (lp * weights.float()).sum().backward()
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
        torch.testing.assert_close(local.grad.double(), ref_grad, rtol=0, atol=2e-6)
        assert not local.grad[~keep].any()


def test_truncation_keeps_ties_with_the_cut() -> None:
    """bf16 logits tie often: every logit equal to the k-th largest (top-k), or to the last one top-p needs,
    stays in, whatever the sort order."""
    torch.manual_seed(5)
    logits = torch.randint(-4, 4, (16, 40)).to(torch.bfloat16)
    targets = logits.argmax(-1)
    for top_k, top_p in ((3, 1.0), (0, 0.5), (4, 0.7)):
        ref_lp, ref_entropy, _, _, keep = _truncated_reference(logits, targets, 1.0, top_k, top_p)
        lp, entropy = vocab_parallel_logprobs(logits, targets, top_k=top_k, top_p=top_p, with_entropy=True)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-6)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=5e-6)
        assert (keep.sum(-1) > max(top_k, 1)).any()  # the test has ties at the boundary


@pytest.mark.parametrize("candidates", [3, 1024, None])
def test_top_p_cut_from_the_largest_logits_or_the_sorted_row(candidates: int | None) -> None:
    """Top-p first looks among each row's `candidates` largest logits; a row whose candidates hold less than
    top_p is sorted whole (None: every row is). Peaked rows (a few tokens hold the nucleus) and flat ones (they
    do not) get the kept set of the float64 definition either way."""
    torch.manual_seed(8)
    logits = torch.cat([torch.randn(6, 60) * 8, torch.randn(6, 60) * 0.3])  # peaked, then flat rows
    for top_k, top_p in ((0, 0.7), (0, 0.95), (20, 0.8), (2, 0.99)):
        cut = truncation_cut(logits, top_k, top_p, candidates=candidates)
        kept = torch.isfinite(truncated_log_softmax(logits, top_k, top_p))
        assert torch.equal(logits >= cut[:, None], kept), (top_k, top_p)
    # with 3 candidates the flat rows need more than 3 tokens, so both ways were taken
    counts = torch.isfinite(truncated_log_softmax(logits, 0, 0.7)).sum(-1)
    assert (counts[:6] <= 3).any() and (counts[6:] > 3).all()


def test_truncation_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="top_k=-1"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), top_k=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        vocab_parallel_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), top_p=0.0)


def _tensor_parallel_truncated(rank: int, world: int, layout: str, top_k: int, top_p: float):
    """One rank's slice of the 50-token vocabulary: torch.chunk's uneven layout (DTensor: 26 + 24 columns) or
    megatron's padded one (2 x 32 columns, the last 14 padding holding large logits)."""
    torch.manual_seed(6)
    logits, targets = torch.randn(13, 50) * 3, torch.randint(0, 50, (13,))
    logits[:, 30:] -= 30  # rank 1's columns fall below every cut in most rows: a rank with nothing kept
    if layout == "padded":
        logits = torch.cat([logits, torch.full((13, 14), 40.0)], dim=-1)
    width = 26 if layout == "uneven" else 32
    local = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_()
    lp, entropy = vocab_parallel_logprobs(local, targets, group=dist.group.WORLD, vocab_start=rank * width,
                                          vocab_size=50, temperature=0.8, chunk_tokens=4, with_entropy=True,
                                          top_k=top_k, top_p=top_p)
    (lp * torch.linspace(-1, 2, 13)).sum().backward()
    return logits, targets, lp.detach(), entropy, local.grad


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["uneven", "padded"])
@pytest.mark.parametrize("top_k,top_p", [(6, 1.0), (0, 0.9), (20, 0.7)])
def test_truncated_logprobs_under_tensor_parallel_equal_the_float64_definition(layout: str, top_k: int,
                                                                                top_p: float) -> None:
    """TP=2 over gloo: top-k from each rank's candidates, top-p from gathered rows, on both engines' vocabulary
    layouts; every rank gets the full answer and its slice of the gradient (float32 against float64: the
    targets the cut would drop sit near -45, where 1e-6 relative is a few ulp)."""
    results = run_distributed(_tensor_parallel_truncated, 2, args=(layout, top_k, top_p))
    logits, targets = results[0][0], results[0][1]
    ref_lp, ref_entropy, ref_grad, _, _ = _truncated_reference(logits, targets, 0.8, top_k, top_p, vocab_size=50)
    for _, _, lp, entropy, _ in results:
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(entropy.double(), ref_entropy, rtol=1e-6, atol=5e-6)
    grad = torch.cat([r[4] for r in results], dim=-1)[:, :50]
    torch.testing.assert_close(grad.double(), ref_grad[:, :50], rtol=1e-6, atol=2e-6)
    assert torch.isfinite(torch.cat([r[4] for r in results], dim=-1)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (50, 0.95)])
def test_truncated_kernel_on_cuda_equals_a_float64_reference(top_k: int, top_p: float) -> None:
    """bf16 logits at a 152k vocabulary on the GPU: peaked rows (the top-p candidates hold the nucleus) and
    flat rows (the sorted fallback), against a float64 CPU computation of the same definition (sorted here:
    the pairwise reference is too big at this vocabulary)."""
    torch.manual_seed(9)
    tokens, temperature = 64, 0.8
    logits = torch.randn(tokens, QWEN_VOCAB) * 1.5
    logits[: tokens // 2, :300] += 10.0
    logits = logits.to(torch.bfloat16)
    targets = torch.randint(0, 300, (tokens,))
    weights = torch.linspace(-1, 2, tokens)
    leaf_ref = logits.double().requires_grad_()
    x = leaf_ref / temperature
    z = x.detach()
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= z.topk(top_k, dim=-1).values[:, -1:]
    ordered = z.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True).values
    probs = torch.softmax(ordered, -1)
    count = (probs.cumsum(-1) - probs < top_p).sum(-1, keepdim=True)
    keep &= z >= ordered.gather(-1, count - 1)
    keep[torch.arange(tokens), targets] = True
    logp = torch.log_softmax(x.masked_fill(~keep, float("-inf")), -1)
    ref_lp = logp.gather(-1, targets[:, None])[:, 0]
    (ref_lp * weights.double()).sum().backward()
    ref_entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).detach()
    leaf = logits.to("cuda").requires_grad_()
    lp, entropy = vocab_parallel_logprobs(leaf, targets.to("cuda"), temperature=temperature, chunk_tokens=16,
                                          with_entropy=True, top_k=top_k, top_p=top_p)
    (lp * weights.to("cuda")).sum().backward()
    torch.testing.assert_close(lp.cpu().double(), ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.cpu().double(), ref_entropy, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(leaf.grad.cpu().double(), leaf_ref.grad, rtol=1e-2, atol=1e-5)  # a bf16 gradient
    if not top_k:  # both of top-p's ways ran: within the 1024 candidates, and the sort
        assert keep[: tokens // 2].sum(-1).max() <= 1024 < keep[tokens // 2:].sum(-1).min()
