"""`ToyEngine`: the DTensor engine under another name, plus a metric that shows it was the one used.

Not registered with `@register_engine`: only the `rl_core.engines` entry point in pyproject.toml names it.
Its config section is `policy.engine_cfg` (the inherited `validate_config` reads `policy.engine_options`).
"""

from __future__ import annotations

from engine_dtensor.engine import DTensorEngine
from rl_core.batch import LossFn, TokenBatch


class ToyEngine(DTensorEngine):
    def train_batch(self, batch: TokenBatch, loss_fn: LossFn) -> dict[str, float]:
        return {**super().train_batch(batch, loss_fn), "toy_engine_steps": 1.0}
