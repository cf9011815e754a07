"""What every worker process sets up first: the driver's log level and format, and no progress bars.

Imports neither torch nor transformers, so that the reward worker (grpo_app.reward_worker) needs neither.
"""

from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "GRPO_LOG_LEVEL"  # the driver's log level, set by cluster.start_ray


def setup_worker_logging() -> None:
    """The driver's --log-level (cluster.start_ray) and format for this worker's logging; no progress bars from
    transformers or huggingface_hub (loading weights): from every rank they would interleave in the driver's log,
    where Ray turns each redraw into a line of its own. Both read the switch as they are imported, which in a
    worker is after this (its actor class's module imports neither)."""
    logging.basicConfig(level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
