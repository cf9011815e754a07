"""An independent float64 reference of the top-k / top-p distribution, for tests of rl_core.logprobs and of
the engines that use it: pairwise comparisons straight from the definition, not the production sort, cumsum
and cut. Tiny vocabularies only (it builds rows x V x V)."""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_log_softmax(x: Tensor, top_k: int = 0, top_p: float = 1.0, targets: Tensor | None = None) -> Tensor:
    """float64 log-softmax of x (N, V) (logits / T) over the tokens a top-k / top-p sampler keeps; -inf elsewhere.

    Top-k (0 or >= V: off) keeps a token with fewer than k tokens strictly above it (ties with the k-th
    stay). Top-p (1: off) then keeps, of the top-k renormalised, a token whose strictly more probable tokens
    hold < top_p (ties with the last one needed stay). `targets` (N,): tokens kept whatever (the sampled one).
    """
    x = x.double()
    above = x[:, None, :] > x[:, :, None]  # [n, i, j]: token j strictly above token i
    kept = torch.ones_like(x, dtype=torch.bool)
    if 0 < top_k < x.shape[-1]:
        kept &= above.sum(-1) < top_k
    if top_p < 1.0:
        p = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
        kept &= (above.double() * p[:, None, :]).sum(-1) < top_p
    if targets is not None:
        kept[torch.arange(x.shape[0]), targets] = True
    return torch.log_softmax(x.masked_fill(~kept, float("-inf")), -1)
