"""Continuous batching over the paged decoder: keep up to `max_num_seqs` rows decoding, refill from a queue.

Requests are the rows of a generate call, prompt-major (prompt 0 sample 0, prompt 0 sample 1, ...), and
are admitted in that order (FIFO) whenever a row is free and the cache has blocks for the newcomer's whole
length (prompt + max_new_tokens), so an admitted row never waits for memory. A prompt is prefilled when
its first sample is admitted: the prompts new in one refill are prefilled together, in packed forwards of
at most `max_prefill_tokens` tokens each (one prompt longer than that runs alone). Its samples share its
full blocks and copy its partial last block (rollout.paged_cache). Finished rows leave the batch at once;
the batch stays dense (rows in admission order) and is padded to a bucket by the decoder, whose step
returns the sampled tokens.

Randomness is keyed on (seed, global row id, step) (rollout.sampling.counter_exponential), so a row's
completion does not depend on which rows share its batch: any `max_num_seqs` gives the same completions.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl_core.interfaces import Completion, SamplingParams
from rollout.paged_cache import NULL_BLOCK
from rollout.paged_decoder import PagedDecoder
from rollout.sampling import row_keys, sample_next

DEFAULT_MAX_PREFILL_TOKENS = 8192

logger = logging.getLogger(__name__)


def table_width(decoder: PagedDecoder, prompts: list[list[int]], params: SamplingParams) -> int:
    """Block-table width of a call: blocks of its longest row, rounded up to a power of two so that
    calls of similar lengths reuse the same captured decode graphs."""
    longest = max(len(p) for p in prompts) + params.max_new_tokens - 1
    return 1 << (-(-longest // decoder.block_size) - 1).bit_length()


@dataclass
class _Prefix:
    """A prompt with blocks: held until its last sample is admitted; logits of its last position once
    prefilled."""

    prompt: int
    blocks: list[int]
    samples_left: int
    logits: Tensor | None = None


@dataclass
class _Row:
    """One decoding sequence (a prompt x sample)."""

    request: int  # global row id: prompt_index * n + sample
    prompt_len: int
    table: list[int]
    table_row: Tensor  # the table padded with the null block to the step's width (CPU int64)
    prefix: _Prefix | None = None  # until the first token is sampled
    copy_on_write: tuple[int, int] | None = None  # (prompt's partial block, own copy), done after prefill
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class ContinuousBatcher:
    """Runs one generate call: admission, prefill, decode steps, stop handling, block bookkeeping.

    `events` records ("admit", request, step) and ("finish", request, step) in order, `batch_sizes` the
    rows of every decode step (for tests and benchmarks).
    """

    def __init__(self, decoder: PagedDecoder, prompts: list[list[int]], params: SamplingParams,
                 stop_ids: set[int], *, max_num_seqs: int, seed: int,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS) -> None:
        self.decoder, self.prompts, self.params = decoder, prompts, params
        self.stop_ids, self.max_num_seqs, self.max_prefill_tokens = stop_ids, max_num_seqs, max_prefill_tokens
        self.cache = decoder.cache
        num_requests = len(prompts) * params.n
        self.keys = row_keys(seed, torch.arange(num_requests))  # (requests,) on the CPU, like the bookkeeping
        self.waiting: deque[int] = deque(range(num_requests))
        self.prefixes: dict[int, _Prefix] = {}
        self.running: list[_Row] = []
        self.results: list[Completion | None] = [None] * num_requests
        self.width = table_width(decoder, prompts, params)
        self.step = 0
        self.events: list[tuple[str, int, int]] = []
        self.batch_sizes: list[int] = []
        self.prefill_sizes: list[int] = []  # prompt tokens of each packed prefill forward

    # ------------------------------------------------------------------ admission
    def _blocks_to_admit(self, request: int) -> int:
        """Fresh blocks the next request takes: its private blocks, plus its prompt's if not prefilled."""
        p, bs = request // self.params.n, self.cache.block_size
        prompt_len, prefix = len(self.prompts[p]), self.prefixes.get(p)
        total = self.cache.blocks_for(prompt_len + self.params.max_new_tokens - 1)
        own = total - prompt_len // bs  # full prompt blocks are shared
        if prompt_len % bs and (prefix.samples_left if prefix else self.params.n) == 1:
            own -= 1  # the last sample inherits the prompt's partial block
        return own + (0 if prefix else self.cache.blocks_for(prompt_len))

    def _admit(self, request: int) -> _Row:
        """Allocate the request's blocks (and its prompt's, if this is its first sample); the prompt's K/V
        are written by `_prefill` before the row's table is read."""
        p, alloc, bs = request // self.params.n, self.cache.allocator, self.cache.block_size
        prompt = self.prompts[p]
        if p not in self.prefixes:
            self.prefixes[p] = _Prefix(p, alloc.allocate(self.cache.blocks_for(len(prompt))), self.params.n)
        prefix = self.prefixes[p]
        prefix.samples_left -= 1
        inherit = prefix.samples_left == 0  # the last sample takes over the prompt's own references
        full = prefix.blocks[: len(prompt) // bs]
        if not inherit:
            alloc.share(full)
        table, copy_on_write = list(full), None
        if len(prompt) % bs and inherit:
            table.append(prefix.blocks[-1])  # written by decode only after the other samples copied it
        elif len(prompt) % bs:  # copy on write: this sample will write into the partial block
            (own,) = alloc.allocate(1)
            copy_on_write = (prefix.blocks[-1], own)
            table.append(own)
        total = self.cache.blocks_for(len(prompt) + self.params.max_new_tokens - 1)
        table += alloc.allocate(total - len(table))
        if inherit:
            del self.prefixes[p]
        self.events.append(("admit", request, self.step))
        table_row = torch.tensor(table + [NULL_BLOCK] * (self.width - len(table)), dtype=torch.int64)
        return _Row(request, len(prompt), table, table_row, prefix, copy_on_write)

    def _prefill(self, prefixes: list[_Prefix]) -> None:
        """Prefill the prompts of `prefixes` in packed forwards of at most max_prefill_tokens tokens each."""
        chunk: list[_Prefix] = []
        for i, prefix in enumerate(prefixes):
            chunk.append(prefix)
            tokens = sum(len(self.prompts[c.prompt]) for c in chunk)
            following = prefixes[i + 1] if i + 1 < len(prefixes) else None
            if following is None or tokens + len(self.prompts[following.prompt]) > self.max_prefill_tokens:
                logits = self.decoder.prefill([self.prompts[c.prompt] for c in chunk], [c.blocks for c in chunk])
                for c, row_logits in zip(chunk, logits):
                    c.logits = row_logits
                self.prefill_sizes.append(tokens)
                chunk = []

    def refill(self) -> None:
        """Admit waiting requests FIFO while a row is free and the cache has room; prefill their new prompts
        together and sample their first token.

        Repeats while admissions free rows again (a first token that is a stop token ends its row at once).
        """
        while True:
            admitted: list[_Row] = []
            while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs \
                    and self._blocks_to_admit(self.waiting[0]) <= self.cache.allocator.num_free:
                admitted.append(self._admit(self.waiting.popleft()))
            if not admitted:
                break
            prefixes = list({id(r.prefix): r.prefix for r in admitted if r.prefix.logits is None}.values())
            self._prefill(prefixes)
            logits = torch.stack([row.prefix.logits for row in admitted])
            for row in admitted:
                if row.copy_on_write is not None:
                    self.cache.copy_block(*row.copy_on_write)
                row.prefix = row.copy_on_write = None
            keys = self.keys[[r.request for r in admitted]].to(logits.device)
            tokens, logprobs = sample_next(logits, self.params, keys_B=keys, steps_B=torch.zeros_like(keys))
            self._append(admitted, tokens, logprobs)
            self.running += [row for row in admitted if self.results[row.request] is None]
        if self.waiting and not self.running:
            need = self._blocks_to_admit(self.waiting[0]) * self.cache.block_size
            raise ValueError(f"the paged KV cache ({self.cache.num_blocks - 1} blocks) cannot hold one request "
                             f"of {need} positions; raise TorchGenerationBackend(kv_cache_tokens=...)")

    # ------------------------------------------------------------------ decoding
    def _append(self, rows: list[_Row], tokens: Tensor, logprobs: Tensor) -> None:
        """Append the sampled token (len(rows),) and logprob of each row; finish rows that stop or run out."""
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            stopped = token in self.stop_ids
            if stopped or len(row.tokens) == self.params.max_new_tokens:
                self.results[row.request] = Completion(
                    prompt_index=row.request // self.params.n, token_ids=row.tokens, logprobs=row.logprobs,
                    finish_reason="stop" if stopped else "length")
                self.cache.allocator.release(row.table)
                self.events.append(("finish", row.request, self.step))

    def decode_step(self) -> None:
        """Refill, then one decode step over every running row; finished rows leave the batch."""
        self.refill()
        rows = self.running
        self.batch_sizes.append(len(rows))
        if rows:
            tokens = torch.tensor([r.tokens[-1] for r in rows])
            positions = torch.tensor([r.prompt_len + len(r.tokens) - 1 for r in rows])
            tables = torch.stack([r.table_row for r in rows])
            steps = torch.tensor([len(r.tokens) for r in rows])
            keys = self.keys[[r.request for r in rows]]
            self._append(rows, *self.decoder.decode(tokens, positions, tables, keys, steps, self.params))
            self.running = [r for r in rows if self.results[r.request] is None]
        self.step += 1

    def run(self) -> list[Completion]:
        """Generate every request; completions in request order (prompt-major)."""
        while self.waiting or self.running:
            self.decode_step()
        return self.results  # type: ignore[return-value]
