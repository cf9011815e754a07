"""Per-token KL estimators between the policy and a reference policy (Schulman's k1/k2/k3).

With logr = ref_logprobs - logprobs (tokens sampled from the policy):
  k1 = -logr            unbiased, can be negative
  k2 = logr**2 / 2      biased, low variance
  k3 = exp(logr) - 1 - logr   unbiased and >= 0 (the default, as in GRPO)
`input_clamp` bounds logr before the estimator (exp overflow), `output_clamp` bounds the result.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_core.config import KLKind


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kind: KLKind = "k3",
    input_clamp: float | None = 20.0,
    output_clamp: float | None = 10.0,
) -> Tensor:
    """Per-token KL estimate, same shape as the inputs."""
    logr = ref_logprobs - logprobs
    if input_clamp is not None:
        logr = logr.clamp(-input_clamp, input_clamp)
    if kind == "k1":
        kl = -logr
    elif kind == "k2":
        kl = logr.square() / 2
    elif kind == "k3":
        kl = torch.exp(logr) - 1 - logr
    else:
        raise ValueError(f"kl kind {kind!r} is not known; choose one of 'k1', 'k2', 'k3'")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl
