"""Shared fixtures: tiny HF checkpoints built locally (rl_core.testing.tiny_models), never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.testing.tiny_models import build_tokenizer, cached_tiny_checkpoint

EOS = 2
PROMPT_TEXTS = ["1+2=", "Hello there, how", "x", "The quick brown fox jumps", "7*8"]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_ckpt(model_cache: Path) -> Path:
    return cached_tiny_checkpoint("qwen2", seed=0, cache_dir=model_cache)


@pytest.fixture(scope="session")
def tiny_ckpt_other(model_cache: Path) -> Path:
    return cached_tiny_checkpoint("qwen2", seed=1, cache_dir=model_cache)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    return [[tokenizer.bos_token_id] + tokenizer.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


class HFReference:
    """Independent references from a plain HF model (unpadded `generate`, single-sequence forwards) and a
    float64 top-k / top-p filter."""

    @staticmethod
    def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
        """HF generate on one unpadded prompt: the reference greedy continuation."""
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0,
                             top_k=None, top_p=None, temperature=None)
        return out[0, len(prompt):].tolist()

    @staticmethod
    def logprobs(model, prompt: list[int], completion: list[int], temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
        """Logprobs of `completion` under a fresh single-sequence HF forward pass: log_softmax(logits / T) in
        float64 (no production helper) over the full vocabulary, or with top_k / top_p over the tokens they
        keep (`filter_bounds`' `may`: ties at the boundary stay); returned as float32 like the backends'."""
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].double()  # the logits that predict `completion`
        x = logits / temperature
        if top_k > 0 or top_p < 1.0:
            kept = torch.stack([HFReference.filter_bounds(row, temperature, top_k, top_p)[1] for row in logits])
            x = x.masked_fill(~kept, float("-inf"))
        logprobs = torch.log_softmax(x, dim=-1)
        return logprobs.gather(-1, ids[0, len(prompt):, None]).squeeze(-1).float()

    @staticmethod
    def filter_bounds(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      tol: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Top-k / top-p of one row of logits as HF's warpers and vLLM define them, in float64: (must, may, count).

        On x = logits / T: top-k (0 or >= V: off) keeps every token with fewer than k tokens above it, so
        ties with the k-th largest stay (HF drops `scores < topk(scores, k)[-1]`). Top-p (1: off) then keeps,
        of the top-k tokens renormalised, the smallest set of most probable tokens whose probability sums
        to >= top_p (at least one token). Which of several tied tokens that set holds depends on a sort's tie
        order, so the result is bounds: `may` holds the tokens some tie order keeps (the mass of the tokens
        strictly more probable is < top_p), `must` those every order keeps, and `count` the set's size.
        Pairwise (V x V) comparisons, not the production filter's sort + cumsum + scatter: tiny vocabularies
        only. `tol` widens both bounds (x compared within tol, masses within tol) for logits computed by
        another implementation.
        """
        x = logits_V.double() / (temperature if temperature > 0 else 1.0)
        finite = torch.isfinite(x)
        others = ~torch.eye(x.numel(), dtype=torch.bool)
        surely_above = x[None, :] > x[:, None] + tol  # [i, j]: token j is more probable than token i
        maybe_above = (x[None, :] > x[:, None] - tol) & others
        above_or_tied = (x[None, :] >= x[:, None] - tol) & others  # j != i may come before i in a sort
        in_k, may, must = finite.clone(), finite.clone(), finite.clone()
        if 0 < top_k < x.numel():  # ties with token i never push it out of the top-k
            in_k &= (x[None, :] > x[:, None]).sum(1) < top_k
            may &= surely_above.sum(1) < top_k
            must &= maybe_above.sum(1) < top_k
        if top_p >= 1.0:
            return must, may, int(in_k.sum())
        p = torch.where(in_k, torch.exp(x - x[in_k].max()), 0.0)
        p = p / p.sum()  # the top-k tokens renormalised
        may &= surely_above.double() @ p < top_p + tol
        must &= above_or_tied.double() @ p < top_p - tol
        # The set's size: the smallest m whose m most probable tokens hold >= top_p.
        prefix_mass = p[in_k].sort(descending=True).values.cumsum(0)
        return must, may, min(1 + int((prefix_mass < top_p).sum()), int(in_k.sum()))


@pytest.fixture(scope="session")
def hf_ref() -> type[HFReference]:
    return HFReference
