"""Prompt streams for the loop: endless epochs over tokenised prompts, shuffled from a seed, resumable.

The prompts themselves (rendering, chat templates, tokenisation, metadata) are rollout.datasets'
`PromptExample`s, from local files or the built-in tasks' generators.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from typing import Any

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

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of what decides the stream: the prompts' token ids, in order, and the shuffle seed."""
        content = json.dumps([self.seed, [item.prompt_token_ids for item in self.items]])
        return hashlib.sha256(content.encode()).hexdigest()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.items),
                "fingerprint": self.fingerprint}

    def resume_problem(self, state: dict[str, Any]) -> str | None:
        """Why `state` (a checkpoint's) would not continue this stream as the original run did; None if it would."""
        size, saved_size = len(self.items), state.get("size")  # size, fingerprint: recorded by newer versions
        if state["position"] > size or saved_size not in (None, size):
            return (f"the checkpoint's run had {saved_size or 'more'} train prompts and had used {state['position']} "
                    f"of epoch {state['epoch']}; this config gives {size}")
        if state.get("fingerprint", self.fingerprint) != self.fingerprint:
            return "the train prompts (their content or order) or grpo.seed differ from the checkpoint's run"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # past the end of a smaller prompt set (allowed by checkpointing.allow_config_change): the epoch is over
        self.epoch, self.position = state["epoch"], min(state["position"], len(self.items))
        self._order = self._epoch_order()
