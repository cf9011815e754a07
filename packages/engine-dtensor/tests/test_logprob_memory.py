"""Chunked logprobs at Qwen2.5's 152k vocabulary: no float32 tokens x vocab tensor beyond
`policy.logprob_chunk_tokens` rows in compute_logprobs or a GRPO forward/backward (bf16 model), and the
results equal the unchunked run."""

from __future__ import annotations

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import full_grads, make_policy
from rl_core.config import LossConfig
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.distributed import run_distributed
from rl_core.testing.memory import LargestTensors
from rl_core.testing.tiny_models import cached_tiny_checkpoint

QWEN_VOCAB = 151936
CHUNK = 48  # rows of logits per fp32 log-softmax
SHAPE = dict(vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2)


def _run(rank: int, world: int, path: str, batch, chunk: int) -> tuple:
    policy = make_policy(path, precision="bfloat16", logprob_chunk_tokens=chunk, logprob_batch_size=8,
                         train_micro_batch_size=8, sequence_packing={"enabled": True})
    engine = DTensorEngine(policy)
    with LargestTensors(last_dim=QWEN_VOCAB) as seen:
        logprobs = engine.compute_logprobs(batch)
        result = engine.forward_backward(batch, ClippedPGLoss(LossConfig()))
    grads = full_grads(engine)
    return seen.numel(torch.float32), logprobs, result.loss, grads


def test_dtensor_logprobs_and_grads_stay_within_the_chunk_at_152k_vocab() -> None:
    path = str(cached_tiny_checkpoint("qwen2", **SHAPE))
    batch = random_token_batch(QWEN_VOCAB, [60, 45, 70, 33], seed=0)  # 208 tokens in one packed row
    batch = batch.with_fields(prev_logprobs=[torch.zeros(n) for n in batch.lengths])
    fp32, logprobs, loss, grads = run_distributed(_run, 1, args=(path, batch, CHUNK))[0]
    whole_fp32, whole_logprobs, whole_loss, whole_grads = run_distributed(_run, 1, args=(path, batch, 10**6))[0]
    assert fp32 <= CHUNK * QWEN_VOCAB, fp32
    assert whole_fp32 >= sum(batch.lengths) * QWEN_VOCAB  # unchunked: the whole row at once
    for got, ref in zip(logprobs, whole_logprobs):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, whole_grads[name], rtol=1e-3, atol=1e-6, msg=name)
