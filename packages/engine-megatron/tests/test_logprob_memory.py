"""Chunked logprobs at Qwen2.5's 152k vocabulary (bf16 model, logits kept in bf16): no float32
tokens x vocab tensor beyond `policy.logprob_chunk_tokens` rows in compute_logprobs or a GRPO
forward/backward, and the results equal the unchunked run."""

from __future__ import annotations

import pytest
import torch
from megatron_testutil import LOSS, make_policy
from torch.utils._python_dispatch import TorchDispatchMode

from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.distributed import run_distributed
from rl_core.testing.memory import LargestTensors
from rl_core.testing.tiny_models import cached_tiny_checkpoint

QWEN_VOCAB = 151936  # a multiple of 128: megatron adds no padded columns
CHUNK = 48
SHAPE = dict(vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2)


def _run(rank: int, world: int, path: str, batch, chunk: int) -> tuple:
    from engine_megatron.engine import MegatronEngine
    from engine_megatron.model import gpt_model

    policy = make_policy(path, precision="bfloat16", logprob_chunk_tokens=chunk, logprob_batch_size=8,
                         train_micro_batch_size=8)
    engine = MegatronEngine(policy)
    with LargestTensors(last_dim=QWEN_VOCAB) as seen:
        logprobs = engine.compute_logprobs(batch)
        result = engine.forward_backward(batch, ClippedPGLoss(LOSS))
    grads = {n: p.main_grad.float().clone() for n, p in gpt_model(engine.model).named_parameters()}
    return seen.numel(torch.float32), logprobs, result.loss, grads


def test_megatron_logprobs_and_grads_stay_within_the_chunk_at_152k_vocab() -> None:
    path = str(cached_tiny_checkpoint("qwen2", **SHAPE))
    batch = random_token_batch(QWEN_VOCAB, [60, 45, 70, 33], seed=0)  # 208 tokens, padded rows of 70
    batch = batch.with_fields(prev_logprobs=[torch.zeros(n) for n in batch.lengths])
    fp32, logprobs, loss, grads = run_distributed(_run, 1, args=(path, batch, CHUNK))[0]
    whole_fp32, whole_logprobs, whole_loss, whole_grads = run_distributed(_run, 1, args=(path, batch, 10**6))[0]
    assert fp32 <= CHUNK * QWEN_VOCAB, fp32
    assert whole_fp32 >= 4 * 70 * QWEN_VOCAB  # unchunked: every row at once
    for got, ref in zip(logprobs, whole_logprobs):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-3, atol=1e-6, msg=name)


class _WholeLogitsReductions(TorchDispatchMode):
    """Counts ops that reduce a (..., vocab) tensor of more than `rows` rows to a single number."""

    def __init__(self, vocab: int, rows: int) -> None:
        super().__init__()
        self.vocab, self.rows, self.count = vocab, rows, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        whole = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[-1] == self.vocab
                 and a.numel() > self.rows * self.vocab]
        self.count += bool(whole) and isinstance(out, torch.Tensor) and out.dim() == 0
        return out


def _logprob_reductions(rank: int, world: int, path: str, batch) -> tuple:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(path, precision="bfloat16", logprob_chunk_tokens=CHUNK,
                                        logprob_batch_size=8, train_micro_batch_size=8))
    with _WholeLogitsReductions(QWEN_VOCAB, CHUNK) as forward_only:
        engine.compute_logprobs(batch)
    with _WholeLogitsReductions(QWEN_VOCAB, CHUNK) as training:
        engine.forward_backward(batch, ClippedPGLoss(LOSS))
    return forward_only.count, training.count


def test_megatron_compute_logprobs_never_reads_the_whole_logits() -> None:
    """compute_logprobs hands megatron a zero loss per micro-batch without reading the logits (no backward
    follows); a training pass's padding micro-batches keep their `logits.sum() * 0` for the backward."""
    path = str(cached_tiny_checkpoint("qwen2", **SHAPE))
    batch = random_token_batch(QWEN_VOCAB, [60, 45, 70, 33], seed=0)
    batch = batch.with_fields(prev_logprobs=[torch.zeros(n) for n in batch.lengths])
    forward_only, training = run_distributed(_logprob_reductions, 1, args=(path, batch))[0]
    assert forward_only == 0, forward_only
    assert training == 0, training  # every micro-batch here carries sequences: the loss reads chunks only
