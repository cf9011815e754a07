"""TRL's side of bench/grpo_vs_trl.py: TRL 1.16 `GRPOTrainer` on the shared workload, run in the TRL venv.

Not a workspace script: grpo_vs_trl.py runs it as `<venv-trl>/bin/python bench/trl_side.py SPEC.json OUT.json`.
SPEC holds the model dir, the prompts (with their repeat_char targets), the device and the training settings;
OUT gets per-step wall times, mean completion lengths and rewards, and on CUDA the process's
torch.cuda.max_memory_allocated. On CUDA: bf16 autocast over fp32 weights (as our engines' bf16 keeps fp32
master weights), per-device batch = the prompt count and `generations` accumulation steps, so one
optimizer step takes all prompts x generations completions. The reward is rollout.rewards.toy.repeat_char_reward
with stop_bonus=0, loaded from its file (it needs only the standard library; this venv does not hold the workspace).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

logger = logging.getLogger("trl_side")
# rollout's toy tasks by file path: the very reward function our side scores with.
_TOY = Path(__file__).resolve().parents[1] / "packages/rollout/src/rollout/rewards/toy.py"
_spec = importlib.util.spec_from_file_location("rollout_toy_tasks", _TOY)
toy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toy)


def make_reward(answer_len: int):
    def repeat_char(prompts, completions, target, **_):
        return [toy.repeat_char_reward(prompt=p, completion=c, metadata={"target": t}, answer_len=answer_len,
                                       stop_bonus=0.0) for p, c, t in zip(prompts, completions, target)]

    return repeat_char


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.start, self.seconds = 0.0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.start)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(spec["threads"])
    ds = Dataset.from_dict({"prompt": [p["prompt"] for p in spec["prompts"]],
                            "target": [p["target"] for p in spec["prompts"]]})
    n, cuda = spec["generations"], spec["device"] == "cuda"
    # CPU: one batch of prompts x n; CUDA: the layout, batch = prompts, n accumulation steps (one
    # generation round of prompts x n completions either way)
    batch, accumulation = (len(spec["prompts"]), n) if cuda else (len(spec["prompts"]) * n, 1)
    # comparable work on CPU: full-length completions (ours has no stop token there)
    generation_kwargs = {"min_new_tokens": spec["max_new_tokens"]} if spec["full_length"] else {}
    cfg = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=not cuda, bf16=cuda, fp16=False, seed=spec["seed"],
        per_device_train_batch_size=batch, num_generations=n, gradient_accumulation_steps=accumulation,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0,
        generation_kwargs=generation_kwargs,
        beta=0.0, loss_type="dapo", epsilon=spec["eps_low"], epsilon_high=spec["eps_high"], num_iterations=1,
        scale_rewards="group", learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=spec["max_grad_norm"],
        max_steps=spec["steps"], use_vllm=False, logging_steps=1, report_to="none", save_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    timer = StepTimer()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=make_reward(spec["answer_len"]), args=cfg,
                          train_dataset=ds, processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    out = {"step_s": timer.seconds, "torch": torch.__version__,
           "completion_len": [h.get("completions/mean_length") for h in logs],
           "reward": [h.get("reward") for h in logs],
           "params": sum(p.numel() for p in trainer.model.parameters())}
    if cuda:
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    logger.info("TRL steps: %s", [round(s, 2) for s in timer.seconds])


if __name__ == "__main__":
    main()
