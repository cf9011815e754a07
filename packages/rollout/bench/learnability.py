"""Minimal GRPO on the default toy task: shows that a tiny random model learns it on a CPU.

The smallest loop that uses the real parts: rollout's torch backend samples, rollout's `repeat_char`
environment scores, rl_core's `grpo_advantages` and `clipped_pg_loss` make the loss, a plain HF model
with AdamW trains, and `update_weights` refits the backend every step. No engine, no Ray.

    uv run python packages/rollout/bench/learnability.py [--steps 200] [--seconds 180]

Prints the validation curve (greedy, held-out prompts). tests/test_learnability.py runs `run_grpo`.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

import torch

from rl_core.advantages import grpo_advantages
from rl_core.interfaces import RewardRequest, SamplingParams
from rl_core.logprobs import target_logprobs
from rl_core.losses import clipped_pg_loss
from rl_core.testing.tiny_models import build_tokenizer, cached_tiny_checkpoint
from rollout.environments import create_environment, toy_prompts
from rollout.torch_backend import TorchGenerationBackend

logger = logging.getLogger("learnability")


@dataclass(kw_only=True)
class ToyRunConfig:
    task: str = "repeat_char"
    prompts_per_step: int = 8
    samples_per_prompt: int = 16
    answer_len: int = 4
    lr: float = 1e-3
    temperature: float = 1.0
    stop_bonus: float = 0.2
    charset: str | None = None  # repeat_char targets; None = the task's default
    max_steps: int = 300
    max_seconds: float = 170.0
    val_every: int = 10
    stop_at_gain: float | None = None  # stop once validation reward rose this much (tests)
    num_val_prompts: int = 64
    seed: int = 0


@dataclass
class ToyRunResult:
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, seconds, val reward)

    @property
    def gain(self) -> float:
        return max(v for _, _, v in self.curve) - self.curve[0][2]


def _encode(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)


def _validate(backend, env, tokenizer, val, max_new: int) -> float:
    prompts = [_encode(tokenizer, p["prompt"]) for p in val]
    out = backend.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    requests = [RewardRequest(prompt=p["prompt"], completion=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                              metadata=p["metadata"], finish_reason=c.finish_reason) for p, c in zip(val, out)]
    logger.debug("validation samples: %s", [(r.prompt, r.completion) for r in requests[:6]])
    return sum(r.reward for r in env.score(requests)) / len(requests)


def _policy_loss(model, prompts: list[list[int]], completions, advantages: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """Clipped PG loss (token-mean) of the sampled completions under the trainable HF model."""
    seqs = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1))
    gen = torch.zeros((len(seqs), width - 1))
    for i, (s, c) in enumerate(zip(seqs, completions)):  # right padding: default positions are right
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        start = len(s) - len(c.token_ids) - 1  # logprob index of the first completion token
        mask[i, start: len(s) - 1] = 1
        gen[i, start: len(s) - 1] = torch.tensor(c.logprobs)
    logits = model(input_ids=ids, attention_mask=attn).logits
    lp = target_logprobs(logits[:, :-1], ids[:, 1:], temperature)  # (B, L-1), the sampler's convention
    seq_ids = torch.arange(len(seqs))[:, None].expand_as(mask)
    keep = mask.bool()
    loss, _ = clipped_pg_loss(lp[keep], gen[keep], advantages[:, None].expand_as(mask)[keep], mask[keep],
                              seq_ids[keep], num_valid_tokens=float(mask.sum()), num_valid_seqs=float(len(seqs)))
    return loss


def run_grpo(cfg: ToyRunConfig, cache_dir: str | None = None) -> ToyRunResult:
    """Train for max_steps or max_seconds; validation reward every val_every steps (and at the end)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(cfg.seed)
    ckpt = cached_tiny_checkpoint("qwen2", seed=cfg.seed, cache_dir=cache_dir)
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    backend = TorchGenerationBackend(str(ckpt))
    env = create_environment(cfg.task, num_workers=1, stop_bonus=cfg.stop_bonus)
    task_kwargs = {} if cfg.charset is None else {"charset": cfg.charset}
    train = toy_prompts(cfg.task, 2048, split="train", seed=cfg.seed, **task_kwargs)
    val = toy_prompts(cfg.task, cfg.num_val_prompts, split="validation", seed=cfg.seed, **task_kwargs)
    max_new = cfg.answer_len + 2
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=0.0)
    result, start = ToyRunResult(), time.monotonic()
    result.curve.append((0, 0.0, _validate(backend, env, tokenizer, val, max_new)))
    for step in range(1, cfg.max_steps + 1):
        batch = [train[(step * cfg.prompts_per_step + i) % len(train)] for i in range(cfg.prompts_per_step)]
        prompts = [_encode(tokenizer, p["prompt"]) for p in batch]
        params = SamplingParams(n=cfg.samples_per_prompt, temperature=cfg.temperature, max_new_tokens=max_new,
                                seed=step)
        completions = backend.generate(prompts, params)
        rewards = env.score([RewardRequest(prompt=batch[c.prompt_index]["prompt"],
                                           completion=tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                           metadata=batch[c.prompt_index]["metadata"],
                                           finish_reason=c.finish_reason) for c in completions])
        reward_t = torch.tensor([r.reward for r in rewards])
        group_ids = torch.tensor([c.prompt_index for c in completions])
        advantages = grpo_advantages(reward_t, group_ids)
        loss = _policy_loss(model, prompts, completions, advantages, cfg.temperature)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        backend.update_weights((n, p.detach()) for n, p in model.named_parameters())
        elapsed = time.monotonic() - start
        last = step == cfg.max_steps or elapsed >= cfg.max_seconds
        if step % cfg.val_every == 0 or last:
            result.curve.append((step, elapsed, _validate(backend, env, tokenizer, val, max_new)))
            logger.info("step %d  %.0fs  train reward %.3f  val reward %.3f", step, elapsed,
                        float(reward_t.mean()), result.curve[-1][2])
        if last or (cfg.stop_at_gain is not None and result.gain >= cfg.stop_at_gain):
            break
    env.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=ToyRunConfig.max_steps)
    parser.add_argument("--seconds", type=float, default=ToyRunConfig.max_seconds)
    parser.add_argument("--lr", type=float, default=ToyRunConfig.lr)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=ToyRunConfig.prompts_per_step)
    parser.add_argument("--samples", type=int, default=ToyRunConfig.samples_per_prompt)
    parser.add_argument("--temperature", type=float, default=ToyRunConfig.temperature)
    parser.add_argument("--stop-bonus", type=float, default=ToyRunConfig.stop_bonus)
    parser.add_argument("--seed", type=int, default=ToyRunConfig.seed)
    parser.add_argument("--charset", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.setLevel(logging.DEBUG)
    result = run_grpo(ToyRunConfig(max_steps=args.steps, max_seconds=args.seconds, lr=args.lr,
                                   prompts_per_step=args.prompts, samples_per_prompt=args.samples,
                                   temperature=args.temperature, stop_bonus=args.stop_bonus, seed=args.seed,
                                   charset=args.charset))
    print("step  seconds  val_reward")
    for step, seconds, reward in result.curve:
        print(f"{step:4d}  {seconds:7.1f}  {reward:.3f}")
    print(f"gain (best - initial): {result.gain:+.3f}")


if __name__ == "__main__":
    main()
