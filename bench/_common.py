"""Shared pieces of the bench scripts: the benchmark model, a process-tree peak RSS/PSS sampler, markdown tables.

The benchmark model is one Qwen2-architecture checkpoint (~12M parameters, head_dim 64, the char-level
tokenizer of `rl_core.testing.tiny_models`) built locally and cached, so every script measures the same
model.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RL_STACK_CACHE", Path.home() / ".cache" / "rl-stack"))
# hidden 512, 4 layers, 8 query heads / 4 kv heads (head_dim 64), SwiGLU 1408: ~12M parameters.
BENCH_MODEL = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4}


def bench_model_path() -> Path:
    """The benchmark Qwen2 checkpoint (with tokenizer), built once under ~/.cache/rl-stack/bench-models."""
    path = CACHE / "bench-models" / "qwen2-{hidden_size}h-{num_hidden_layers}l".format(**BENCH_MODEL)
    if not (path / "config.json").exists():
        from rl_core.testing.tiny_models import save_tiny_checkpoint

        logger.info("building the benchmark model at %s", path)
        save_tiny_checkpoint(path, "qwen2", **BENCH_MODEL)
    return path


PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:  # ~20 us: cheap enough to sample often
        return int(f.read().split()[1]) * PAGE


def _pss_bytes(pid: int) -> int:
    """Proportional set size: private pages plus each shared page divided by the processes mapping it."""
    with open(f"/proc/{pid}/smaps_rollup") as f:  # walks the page tables: ~20 ms for a 1.5 GB process
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return "(exited)"


class PeakMemory:
    """Peaks of the summed RSS and PSS of a process and all its descendants, sampled in a thread.

    RSS counts a shared library page once per process that maps it (10 processes importing torch count
    libtorch 10 times); PSS splits each shared page among its users, so the tree's PSS is the memory the
    tree really holds. The sampler must not slow the tree it measures on a 2-core machine: RSS (statm)
    every `interval` s, the process list every second, PSS (smaps_rollup, costly) at most every 5 s and
    only while the RSS is within 5% of its peak (peaks last seconds: the training phase). `peak_procs`: (name, RSS MiB) at the RSS peak.
    """

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak_bytes = self.peak_pss_bytes = 0
        self.peak_procs: list[tuple[str, float]] = []
        self._procs: list[psutil.Process] = []
        self._listed_at = self._pss_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        now = time.monotonic()
        if now - self._listed_at > 1.0:
            try:
                root = psutil.Process(self.pid)
                self._procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            self._listed_at = now
        sizes = {}
        for proc in self._procs:
            try:
                sizes[proc.pid] = _rss_bytes(proc.pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited since the listing
        total = sum(sizes.values())
        if total > self.peak_bytes:
            names = {p.pid: _name(p) for p in self._procs if p.pid in sizes}
            self.peak_bytes = total
            self.peak_procs = sorted(((names[pid], b / 2**20) for pid, b in sizes.items()), key=lambda x: -x[1])
        if total >= 0.95 * self.peak_bytes and now - self._pss_at > 5.0:
            self._pss_at = now
            pss = 0
            for pid in sizes:
                try:
                    pss += _pss_bytes(pid)
                except (FileNotFoundError, ProcessLookupError):
                    continue
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float:
        return self.peak_bytes / 2**20

    @property
    def peak_pss_mib(self) -> float:
        return self.peak_pss_bytes / 2**20


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def long_tail_lengths(n: int, *, median: int, max_len: int, seed: int, sigma: float = 1.0) -> list[int]:
    """`n` lognormal sequence lengths (median `median`, clipped to [16, max_len]): the long-tailed mix."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 16, max_len).astype(int).tolist()


def make_batch(lengths: list[int], vocab: int, seed: int) -> Any:
    """A GRPO training batch: random tokens, loss on the second half of each row, +-1 advantages."""
    import torch

    from rl_core.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    mask = [torch.cat([torch.zeros(n // 2), torch.ones(n - n // 2)]) for n in lengths]
    adv = [torch.full((n,), 1.0 if i % 2 else -1.0) for i, n in enumerate(lengths)]
    return TokenBatch(input_ids=ids, loss_mask=mask, advantages=adv)


def policy_config(model: Path, *, packing: bool, mb_tokens: int, megatron: bool = False, **extra: Any) -> Any:
    """A PolicyConfig for `model`: packed, or padded with dynamic batching, under the same token budget."""
    from rl_core.config import PolicyConfig, parse_config

    raw = {
        "model_name": str(model), "precision": "float32", "train_global_batch_size": 1024,
        "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-5}}, "max_grad_norm": 1.0,
        "sequence_packing": {"enabled": packing, "train_mb_tokens": mb_tokens, "logprob_mb_tokens": mb_tokens},
        "dynamic_batching": {"enabled": not packing, "train_mb_tokens": mb_tokens,
                             "logprob_mb_tokens": mb_tokens, "sequence_length_round": 16},
        "megatron_cfg": {"enabled": megatron},
        **extra,
    }
    return parse_config(PolicyConfig, raw, "policy")


def count_model_tokens(module: Any) -> list[int]:
    """Counter of the token positions (padding included) fed to `module`: a forward pre-hook on input_ids."""
    seen = [0]

    def hook(_mod: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen[0] += int(ids.numel())

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen
