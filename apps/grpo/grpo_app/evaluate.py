"""`uv run apps/grpo eval`: a model's score on the task's validation prompts (mean reward, accuracy, pass@k).

The trainer's own config decides what is evaluated and how: `policy.model_name` (e.g. a run's `step_N/hf`), the
environment, the validation prompts (`env.val_data`, or the built-in task's, `grpo.num_val_prompts` of them),
the chat template and the generation settings. One completion per prompt is greedy, as the trainer's
validation; `--samples K` draws K per prompt at `generation.temperature` (seeded by `grpo.seed`) and reports
pass@1..K. Generation and scoring run in this process: no Ray, no training engine.

    uv run apps/grpo eval --config runs/grpo-cpu-default/config.yaml \\
        policy.model_name=runs/grpo-cpu-default/checkpoints/step_100/hf --samples 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_app.config import GRPOConfig, load_config
from rl_core.checkpoint_io import atomic_write_text
from rl_core.config import ConfigError
from rl_core.interfaces import Completion, GenerationBackend, RewardResult
from rollout.datasets import PromptExample

logger = logging.getLogger("grpo.eval")
# completions per generate call: a progress bar that moves, and enough rows to keep a vLLM batch full
CHUNK_COMPLETIONS = 1024


def pass_at_k(n: int, solved: int, k: int) -> float:
    """The chance that at least one of k completions drawn without replacement from n (`solved` of them solved)
    is solved: the unbiased estimator of Chen et al. (2021), 1 - C(n - solved, k) / C(n, k), as a product."""
    if n - solved < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - solved + 1, n + 1))


def pass_ks(samples: int) -> list[int]:
    """1, 2, 4, ... up to `samples`, and `samples` itself."""
    return sorted({2**i for i in range(samples.bit_length()) if 2**i <= samples} | {samples})


def is_solved(result: RewardResult, threshold: float) -> bool:
    return result.correct if result.correct is not None else result.reward >= threshold


def score_metrics(completions: list[Completion], results: list[RewardResult], samples: int,
                  threshold: float) -> dict[str, float]:
    """Mean reward, accuracy (where the environment judges correctness) and pass@k over the prompts."""
    solved_by_prompt: dict[int, list[bool]] = defaultdict(list)
    for completion, result in zip(completions, results):
        solved_by_prompt[completion.prompt_index].append(is_solved(result, threshold))
    metrics = {"eval/reward_mean": sum(r.reward for r in results) / len(results)}
    graded = [r.correct for r in results if r.correct is not None]
    if graded:
        metrics["eval/accuracy"] = sum(graded) / len(graded)
    for k in pass_ks(samples):
        metrics[f"eval/pass@{k}"] = sum(pass_at_k(len(s), sum(s), k) for s in solved_by_prompt.values()) / len(
            solved_by_prompt)
    metrics["eval/truncated_fraction"] = sum(c.finish_reason == "length" for c in completions) / len(completions)
    return metrics


@dataclass
class EvalInputs:
    """What eval reads before it generates anything (a problem here is the user's input: exit 2, one line)."""

    tokenizer: Any
    prompts: list[PromptExample]
    backend: GenerationBackend


def load_eval_inputs(cfg: GRPOConfig, out: Path) -> EvalInputs:
    """The tokenizer, the validation prompts (as the trainer loads them, whatever grpo.val_every says) and the
    generation backend; `out` checked first, so that no generation is thrown away at the end."""
    from grpo_app.build import load_tokenizer, load_val_prompts
    from rl_core.registry import create_generation_backend

    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name the JSONL file to write (e.g. {out / 'eval.jsonl'})")
    tokenizer = load_tokenizer(cfg.policy.model_name)
    prompts = load_val_prompts(cfg, tokenizer)
    backend = create_generation_backend(cfg.generation.backend, model_path=cfg.policy.model_name,
                                        **cfg.generation.backend_kwargs)
    return EvalInputs(tokenizer, prompts, backend)


def evaluate(cfg: GRPOConfig, inputs: EvalInputs, *, samples: int, threshold: float, out: Path) -> dict[str, float]:
    """Generate `samples` completions per validation prompt with cfg's backend, score them with cfg's
    environment; writes one JSON line per completion to `out` and returns the metrics."""
    from grpo_app.loop import reward_requests
    from rollout.environments import check_reward_failures, create_environment, finite_rewards

    prompts, backend = inputs.prompts, inputs.backend
    logger.info("evaluating %s on %d prompts x %d completion(s) (%s)", cfg.policy.model_name, len(prompts), samples,
                "greedy" if samples == 1 else f"temperature {cfg.generation.temperature}")
    completions = generate_in_chunks(backend, prompts, cfg, samples)
    env = create_environment(cfg.env.name, **cfg.env.kwargs)
    try:
        requests = reward_requests(prompts, completions, inputs.tokenizer)
        results = finite_rewards(env.score(requests))
    finally:
        if hasattr(env, "close"):  # its scoring subprocesses and their directory
            env.close()
    check_reward_failures(results, cfg.env.max_failed_reward_fraction, "env.max_failed_reward_fraction")
    lines = [json.dumps({"prompt_index": c.prompt_index, "prompt": q.prompt, "completion": q.completion,
                         "reward": r.reward, "correct": r.correct, "solved": is_solved(r, threshold),
                         "finish_reason": c.finish_reason, "error": r.error})
             for c, q, r in zip(completions, requests, results)]
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(line + "\n" for line in lines))
    return score_metrics(completions, results, samples, threshold)


def default_out(cfg: GRPOConfig, samples: int) -> Path:
    """`<logger.log_dir>/eval/<model>[-samples<K>].jsonl`, <model> being `step_N` for a run's `step_N/hf` and the
    directory's name otherwise: evaluating the next checkpoint, or the same one with other --samples, keeps the
    completions of the last."""
    model = Path(cfg.policy.model_name)
    label = model.parent.name if model.name == "hf" and re.fullmatch(r"step_\d+", model.parent.name) else model.name
    name = f"{label}-samples{samples}" if samples > 1 else label
    return Path(cfg.logger.log_dir) / "eval" / f"{name}.jsonl"


def generate_in_chunks(backend: GenerationBackend, prompts: list[PromptExample], cfg: GRPOConfig,
                       samples: int) -> list[Completion]:
    """`samples` completions per prompt, prompt-major, generated CHUNK_COMPLETIONS at a time under a progress bar
    (a test set of thousands of prompts is otherwise minutes of silence); each chunk its own seed."""
    from tqdm import tqdm

    from grpo_app.loop import sampling_params

    per_chunk = max(1, CHUNK_COMPLETIONS // samples)
    completions: list[Completion] = []
    with tqdm(total=len(prompts) * samples, desc="eval", unit="completion", disable=None) as bar:
        for chunk, start in enumerate(range(0, len(prompts), per_chunk)):
            part = backend.generate([p.prompt_token_ids for p in prompts[start:start + per_chunk]],
                                    sampling_params(cfg, chunk, n=samples, greedy=samples == 1))
            part.sort(key=lambda c: c.prompt_index)  # stable: a prompt's samples keep their order
            completions += [dataclasses.replace(c, prompt_index=start + c.prompt_index) for c in part]
            bar.update(len(part))
    return completions


def run(args: argparse.Namespace) -> int:
    """`eval` with its parsed options (grpo_app.cli.parse_eval_args): exit 0 with the scores printed (a JSON line),
    2 with one line naming a problem of the inputs, 1 when the reward function fails, 130 on Ctrl-C."""
    from grpo_app.preflight import preflight
    from rollout.environments.base import RewardFailureError

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        try:
            cfg = preflight(load_config(args.config, args.overrides), training=False)
            out = args.out or default_out(cfg, args.samples)
            inputs = load_eval_inputs(cfg, out)
        except (ConfigError, FileNotFoundError, ValueError) as exc:  # the inputs only: an error in generation or
            logger.error("%s", exc)                                   # scoring is a bug and keeps its traceback
            return 2
        metrics = evaluate(cfg, inputs, samples=args.samples, threshold=args.threshold, out=out)
    except RewardFailureError as exc:
        logger.error("%s", exc)
        return 1
    except KeyboardInterrupt:
        logger.error("eval stopped: interrupted")
        return 130
    width = max(map(len, metrics))
    logger.info("%s (completions: %s):\n%s", cfg.policy.model_name, out,
                "\n".join(f"  {name:<{width}}  {value:.4f}" for name, value in metrics.items()))
    print(json.dumps({"model": cfg.policy.model_name, "samples": args.samples, "completions": str(out), **metrics}))
    return 0

