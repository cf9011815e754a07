"""`reward_model`: a Hugging Face sequence-classification reward model as the environment (RLHF's learned reward).

A completion's reward is the model's score of the conversation: the logit `label` (0: a Bradley-Terry reward
model's single output) at the text's last token, as `AutoModelForSequenceClassification` pools it. The text is the
policy's own rendering of the prompt (its chat template, where `env.use_chat_template` is set) followed by the
completion; or, with `chat_template=true`, the reward model's own chat template over the prompt's messages and the
completion as the assistant's turn (what verl does when the reward model's tokenizer is not the policy's: reward
models are trained on their own format). The model's weights are data, not code (`trust_remote_code` stays off), so
it scores in this process, in batches of `batch_size`, not in the sandboxed pool of the function environments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from rl_core.interfaces import RewardRequest, RewardResult
from rollout.environments.base import register_environment

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")


@register_environment("reward_model")
class RewardModelEnvironment:
    """Scores `prompt + completion` with a local sequence-classification checkpoint `model`."""

    def __init__(self, *, model: str, device: str = "cpu", dtype: str = "float32", batch_size: int = 16,
                 max_length: int | None = None, label: int = 0, chat_template: bool = False) -> None:
        # here, not at the module's top: the registry imports this module in every reward worker, most of which
        # score with functions and need neither
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"env.kwargs.model={model!r} is not a local Hugging Face checkpoint directory (no "
                             "config.json); save the reward model with save_pretrained and point at that directory")
        if dtype not in DTYPES:
            raise ValueError(f"env.kwargs.dtype={dtype!r} must be one of {sorted(DTYPES)}")
        if batch_size < 1 or (max_length is not None and max_length < 1):
            raise ValueError(f"env.kwargs.batch_size={batch_size} and max_length={max_length} must be >= 1")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"env.kwargs.device={device!r}, but this process sees no GPU (the trainer's reward "
                             "workers get none): score in the driver with env.num_workers=0, or use device=cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        if chat_template and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"env.kwargs.chat_template=true, but the reward model's tokenizer ({model}) has no chat "
                             "template; set chat_template=false to score the policy's own rendering of the prompt")
        self.chat_template = chat_template
        if self.tokenizer.pad_token_id is None:  # padding is only for batching; the score is at the last real token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        self.model.requires_grad_(False).to(self.device)  # and so `score` records no autograd graph
        if self.model.config.pad_token_id is None:  # where the pooling looks for the last real token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label < self.model.config.num_labels:
            raise ValueError(f"env.kwargs.label={label}: the reward model has {self.model.config.num_labels} "
                             f"output(s); choose one in [0, {self.model.config.num_labels - 1}]")
        self.batch_size, self.max_length, self.label = batch_size, max_length, label
        logger.info("reward model %s (%s, %s) on %s", model, type(self.model).__name__, dtype, self.device)

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        texts = [self._text(r) for r in requests]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            # a chat template writes its own special tokens (BOS); plain text gets the tokenizer's
            batch = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=self.max_length is not None, max_length=self.max_length,
                                   add_special_tokens=not self.chat_template)
            logits = self.model(input_ids=batch["input_ids"].to(self.device),
                                attention_mask=batch["attention_mask"].to(self.device)).logits
            scores += logits[:, self.label].float().tolist()
        return [RewardResult(reward=score) for score in scores]

    def _text(self, request: RewardRequest) -> str:
        if not self.chat_template:
            return request.prompt + request.completion
        if not request.messages:
            raise ValueError("env.kwargs.chat_template=true needs the prompt as chat messages (RewardRequest.messages), "
                             "which this caller did not give")
        conversation = [*request.messages, {"role": "assistant", "content": request.completion}]
        return self.tokenizer.apply_chat_template(conversation, tokenize=False)
