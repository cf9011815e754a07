"""Batch types that cross the engine boundary.

Owns: `TokenBatch` (what a trainer hands an engine), `LossInputs` (what an engine hands a loss for one
micro-batch), `StepResult`, and `host_to_device` (how a micro-batch's host tensors reach the GPU). Does not
own packing or micro-batching: engines do that with seqpack.

Alignment convention, shared by every engine and rollout backend: every per-token field of a sequence
has the sequence's length L. `logprobs[t]` is log p(input_ids[t] | input_ids[:t]) for t >= 1 and 0 at
t = 0 (nothing predicts the first token); `loss_mask[t]` is 1 where token t is a generated token that
the loss trains on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor

PER_TOKEN_FIELDS = ("loss_mask", "advantages", "prev_logprobs", "gen_logprobs", "ref_logprobs")


def host_to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """`tensor.to(device)` that does not make the host wait for the GPU. torch synchronises the stream for
    every copy from pageable host memory (`non_blocking=False`), so a micro-batch's inputs and loss fields
    copied plainly drain the GPU's queue several times per micro-batch; from a pinned copy the transfer is
    queued like a kernel (torch's pinned allocator keeps the buffer until the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(kw_only=True)
class TokenBatch:
    """Variable-length sequences, one 1-D tensor of length L_i per sequence and field."""

    input_ids: list[Tensor]
    loss_mask: list[Tensor]
    advantages: list[Tensor] | None = None
    prev_logprobs: list[Tensor] | None = None
    gen_logprobs: list[Tensor] | None = None
    ref_logprobs: list[Tensor] | None = None

    def __post_init__(self) -> None:
        if len(self.input_ids) == 0:
            raise ValueError("TokenBatch.input_ids is empty: a batch needs at least one sequence")
        lengths = self.lengths
        for name in PER_TOKEN_FIELDS:
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != len(lengths):
                raise ValueError(
                    f"TokenBatch.{name} has {len(values)} sequences but input_ids has {len(lengths)}"
                )
            for i, (value, length) in enumerate(zip(values, lengths)):
                if value.shape != (length,):
                    raise ValueError(
                        f"TokenBatch.{name}[{i}] has shape {tuple(value.shape)}; expected ({length},) "
                        f"to match input_ids[{i}]"
                    )

    @property
    def lengths(self) -> list[int]:
        return [int(x.numel()) for x in self.input_ids]

    def __len__(self) -> int:
        return len(self.input_ids)

    def select(self, indices: Sequence[int]) -> TokenBatch:
        """The sub-batch of the given sequences, in the given order (DP shards, micro-batches)."""
        picked = {}
        for f in fields(self):
            values = getattr(self, f.name)
            picked[f.name] = None if values is None else [values[i] for i in indices]
        return TokenBatch(**picked)

    def with_fields(self, **updates: list[Tensor] | None) -> TokenBatch:
        return replace(self, **updates)

    def __reduce__(self) -> tuple:
        """Pickled (to a Ray actor) as one flat tensor per field plus the lengths: pickling each sequence's tensors
        cost ~0.1 ms apiece, ~47 ms a step for the CPU default's 512; unpickled, the sequences are views of the
        flat tensors. A field whose tensors are not all 1-D host tensors of one dtype pickles as it is."""
        lengths = self.lengths
        flat = {f.name: _flat(getattr(self, f.name)) for f in fields(self)}
        return _from_flat, (lengths, flat)

    def num_valid_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.loss_mask))

    def num_valid_seqs(self) -> int:
        return int(sum(int(m.sum() > 0) for m in self.loss_mask))

    def dummy(self, seq_multiple: int = 1) -> TokenBatch:
        """One sequence of pad tokens with no loss tokens and this batch's optional fields: the zero-weight
        micro-batch a rank with fewer micro-batches runs so that it joins every collective of the others.
        Two tokens (one next-token target), or the engine's `seq_multiple` if that is larger."""
        length = max(2, seq_multiple)
        zeros = [torch.zeros(length)]
        optional = {name: None if getattr(self, name) is None else zeros for name in PER_TOKEN_FIELDS[1:]}
        return TokenBatch(input_ids=[torch.zeros(length, dtype=torch.long)], loss_mask=zeros, **optional)


def _flat(values: list[Tensor] | None) -> Tensor | list[Tensor] | None:
    if values is None or len({(v.dtype, v.device.type, v.dim()) for v in values}) != 1 \
            or values[0].device.type != "cpu" or values[0].dim() != 1:
        return values
    return torch.cat(values)


def _from_flat(lengths: list[int], flat: dict[str, Tensor | list[Tensor] | None]) -> TokenBatch:
    return TokenBatch(**{name: list(value.split(lengths)) if isinstance(value, Tensor) else value
                         for name, value in flat.items()})


@dataclass(kw_only=True)
class LossInputs:
    """Flat per-token tensors of one micro-batch, each (T,), plus global-batch normalisers.

    `seq_ids[t]` names the sequence token t belongs to (unique within the micro-batch). The
    normalisers count the whole global batch over every DP rank, so that summing the losses of all
    micro-batches on all ranks gives the full-batch loss.
    """

    logprobs: Tensor
    mask: Tensor
    seq_ids: Tensor
    num_valid_tokens: float
    num_valid_seqs: float
    advantages: Tensor | None = None
    prev_logprobs: Tensor | None = None
    gen_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None

    @classmethod
    def from_sequences(
        cls,
        batch: TokenBatch,
        logprobs: Sequence[Tensor],
        *,
        num_valid_tokens: float,
        num_valid_seqs: float,
        entropy: Sequence[Tensor] | None = None,
    ) -> LossInputs:
        """Concatenate a micro-batch's per-sequence fields with the engine's per-sequence logprobs."""
        seq_ids = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(batch.lengths)])
        device = logprobs[0].device
        cat = lambda xs: None if xs is None else host_to_device(torch.cat(list(xs)), device)  # noqa: E731
        return cls(
            logprobs=torch.cat(list(logprobs)),
            mask=cat(batch.loss_mask).to(logprobs[0].dtype),
            seq_ids=host_to_device(seq_ids, device),
            num_valid_tokens=float(num_valid_tokens),
            num_valid_seqs=float(num_valid_seqs),
            advantages=cat(batch.advantages),
            prev_logprobs=cat(batch.prev_logprobs),
            gen_logprobs=cat(batch.gen_logprobs),
            ref_logprobs=cat(batch.ref_logprobs),
            entropy=cat(entropy),
        )


# A loss maps one micro-batch to (scalar loss, metrics). Metrics follow rl_core.metrics' reduction rule.
LossFn = Callable[[LossInputs], tuple[Tensor, dict[str, Tensor | float]]]


@dataclass
class StepResult:
    """What one forward_backward call returns, already reduced over micro-batches and DP ranks."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)
    num_micro_batches: int = 0
