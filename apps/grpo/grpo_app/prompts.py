"""Prompt streams for the loop: endless epochs over tokenised prompts, shuffled from a seed, resumable.

The prompts themselves (rendering, chat templates, tokenisation, metadata) are rollout.datasets'
`PromptExample`s, from local files or the built-in tasks' generators.
"""

from __future__ import annotations

import random

from rollout.datasets import PromptExample


class PromptSource:
    """Endless epochs over the items, each epoch in a seeded random order."""

    def __init__(self, items: list[PromptExample], seed: int) -> None:
        if not items:
            raise ValueError("the prompt dataset is empty: check env.train_data or the environment's prompts")
        self.items, self.seed = items, seed
        self.epoch, self.position = 0, 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 7919 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptExample]:
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
