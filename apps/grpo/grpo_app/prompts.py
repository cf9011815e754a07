"""Prompt streams for the loop: tokenised once, shuffled per epoch from a seed, resumable.

Records are dicts with `prompt` (text) or `messages` (chat), plus any metadata the environment needs
(an `answer`, say). They come from local JSONL/Parquet files (rollout.datasets) or from the
environment's own generator (the built-in tasks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptItem:
    text: str
    token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)


def tokenize_records(records: list[dict[str, Any]], tokenizer: Any, *, use_chat_template: bool) -> list[PromptItem]:
    items = []
    for record in records:
        metadata = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        if use_chat_template:
            messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = record["prompt"]
        items.append(PromptItem(text=text, token_ids=tokenizer(text, add_special_tokens=False)["input_ids"],
                                metadata=metadata))
    return items


class PromptSource:
    """Endless epochs over the items, each epoch in a seeded random order."""

    def __init__(self, items: list[PromptItem], seed: int) -> None:
        if not items:
            raise ValueError("the prompt dataset is empty: check env.train_data or the environment's prompts")
        self.items, self.seed = items, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptItem]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order()
            out.append(self.items[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order()
