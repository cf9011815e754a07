"""Shared fixtures: tiny HF checkpoints built locally (rl_core.testing.tiny_models), never downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.logprobs import target_logprobs
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
    """Independent references from a plain HF model: unpadded `generate` and single-sequence forwards."""

    @staticmethod
    def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
        """HF generate on one unpadded prompt: the reference greedy continuation."""
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0,
                             top_k=None, top_p=None, temperature=None)
        return out[0, len(prompt):].tolist()

    @staticmethod
    def logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
        """Logprobs of `completion` under a fresh single-sequence HF forward pass, logits / T, float32."""
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(ids).logits[0]
        return target_logprobs(logits[:-1], ids[0, 1:], temperature)[len(prompt) - 1:]


@pytest.fixture(scope="session")
def hf_ref() -> type[HFReference]:
    return HFReference
