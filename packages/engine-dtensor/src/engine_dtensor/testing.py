"""Test helpers for this package's tests and cross-package parity tests (like rl_core.testing).

Policies for tiny local checkpoints, GRPO-shaped batches with HF-computed prev_logprobs, the plain HF
reference logprobs, unsharded gradients of an engine and a max-abs-diff helper. Needs `transformers`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from engine_dtensor.parallelize import hf_name
from rl_core.batch import TokenBatch
from rl_core.config import PolicyConfig, parse_config
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.truncation import truncated_log_softmax

VOCAB = 128


def make_policy(model_path: str, **overrides: Any) -> PolicyConfig:
    """A validated PolicyConfig for `model_path` (AdamW lr 1e-3, clip 1.0) with dotted-free overrides."""
    data: dict[str, Any] = {
        "model_name": model_path,
        "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3, "weight_decay": 0.01}},
        "max_grad_norm": 1.0,
    }
    data.update(overrides)
    return parse_config(PolicyConfig, data, "policy")


def hf_reference_logprobs(
    model_path: str, seqs: list[torch.Tensor], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> list[torch.Tensor]:
    """Plain HF forward of each sequence alone + log_softmax (of the top-k / top-p truncation, float64, the
    target kept: rl_core.testing.truncation): (L_i,) aligned, 0 at t = 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(input_ids=ids[None]).logits[0].float() / temperature
            if top_k or top_p < 1.0:
                logp = truncated_log_softmax(logits[:-1], top_k, top_p, targets=ids[1:]).float()
            else:
                logp = torch.log_softmax(logits[:-1], -1)
            out.append(torch.cat([torch.zeros(1), logp.gather(-1, ids[1:, None])[:, 0]]))
    return out


def grpo_batch(model_path: str, lengths: list[int] | None = None, seed: int = 0) -> TokenBatch:
    """A GRPO batch whose prev_logprobs are HF logprobs plus noise (so that some ratios clip)."""
    lengths = lengths or [5, 9, 7, 12, 16, 3, 11, 8]
    batch = random_token_batch(VOCAB, lengths, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prev = [
        lp + 0.1 * torch.randn(lp.shape, generator=gen)
        for lp in hf_reference_logprobs(model_path, batch.input_ids)
    ]
    return batch.with_fields(prev_logprobs=prev)


def full_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Unsharded gradients of an engine's model, by HF name (a collective under FSDP/TP)."""
    out = {}
    for name, p in engine.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[hf_name(name)] = g.detach().clone()
    return out


def max_abs_diff(
    a: list[torch.Tensor] | dict[str, torch.Tensor], b: list[torch.Tensor] | dict[str, torch.Tensor]
) -> float:
    """Largest |a - b| over matching tensors (same names / order and shapes required)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise ValueError(f"different names: {sorted(a.keys() ^ b.keys())}")
        pairs = [(a[k], b[k]) for k in a]
    else:
        if len(a) != len(b):
            raise ValueError(f"{len(a)} tensors vs {len(b)}")
        pairs = list(zip(a, b))
    for x, y in pairs:
        if x.shape != y.shape:
            raise ValueError(f"shape {tuple(x.shape)} != {tuple(y.shape)}")
    return max(float((x.detach().double() - y.detach().double()).abs().max()) for x, y in pairs)


# Layout changes (TP, DP, packing, recompute) reorder fp32 sums. Logprobs of random tokens reach -20,
# where one fp32 ulp is 1.9e-6, so "1e-6" is read as 1e-6 absolute plus 8 ulp relative: on an AVX2 machine
# (torch's CPU kernels differ from AVX-512's) TP=2 with sequence parallelism put a logprob of -7.46 6 ulp
# (2.9e-6) from HF's and DP=2 a gradient entry 1.25e-6 from one rank's, where 2 ulp had passed on CI.
LAYOUT_ATOL = 1e-6
LAYOUT_RTOL = 8 * torch.finfo(torch.float32).eps


def assert_layout_close(
    a: list[torch.Tensor] | dict[str, torch.Tensor], b: list[torch.Tensor] | dict[str, torch.Tensor]
) -> float:
    """Every pair within LAYOUT_ATOL + LAYOUT_RTOL * |b|; returns the max abs diff (for reports)."""
    diff = max_abs_diff(a, b)
    pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else list(zip(a, b))
    for x, y in pairs:
        torch.testing.assert_close(x.double(), y.double(), atol=LAYOUT_ATOL, rtol=LAYOUT_RTOL)
    return diff
