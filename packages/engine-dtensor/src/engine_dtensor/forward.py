"""One micro-batch through the model: padded or packed inputs, then per-sequence target logprobs.

Owns the attention-input layout for each kernel:
  * padded rows (B, S): right padding, a causal + key-padding mask;
  * packed row (1, T) built with seqpack: position ids restart per sequence; sdpa_segments (the CPU
    default, attention.py) gets the sequence boundaries as `cu_seq_lens_q` and no mask, sdpa/eager get
    a 4-D block-diagonal causal mask (eager needs it additive: a bool mask is silently wrong there),
    flash_attention_2 gets no mask and finds the sequence boundaries from the position ids (varlen).
and the alignment of the results with the tokens (rl_core.batch): logprobs[t] = log p(tok_t | <t),
0 at t = 0 of every sequence, including the first token of each packed sequence. Does not own
micro-batch planning or the loss (engine.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import seqpack
from engine_dtensor.attention import SEGMENT_SDPA
from rl_core.batch import host_to_device
from rl_core.logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, shift_align, vocab_parallel_logprobs


@dataclass
class ModelInputs:
    input_ids: Tensor  # (B, S) long
    position_ids: Tensor  # (B, S) long
    attention_mask: (
        Tensor | None
    )  # (B, S) for flash padded, (B, 1, S, S) for sdpa/eager, None for flash packed
    unpack: Callable[[Tensor], list[Tensor]]  # (B, S) per-token values -> [(L_i,)] in the micro-batch's order
    attention_kwargs: dict[str, Tensor | int] = field(default_factory=dict)  # passed through to the attention


def _kernel_mask(allowed: Tensor, attn_impl: str) -> Tensor:
    """(B, S, S) bool, True = may attend -> the 4-D mask the HF attention kernel expects."""
    mask = allowed[:, None]  # (B, 1, S, S)
    if attn_impl == "eager":  # eager adds the mask to the scores: it must be additive
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        return zeros.masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask


def build_padded_inputs(
    seqs: list[Tensor], *, attn_impl: str, seq_multiple: int, device: torch.device
) -> ModelInputs:
    """Right-padded (B, S) rows; S is rounded up to `seq_multiple` (the TP size under sequence parallel)."""
    lengths = [int(s.numel()) for s in seqs]
    width = seqpack.round_up(max(lengths), seq_multiple)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : lengths[i]] = s
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, S)
    positions = torch.arange(width).expand(len(seqs), width)
    if attn_impl == "flash_attention_2":
        mask = valid.long()
    else:  # pad query rows still see their sequence's real keys, so no softmax row is empty
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = _kernel_mask(causal[None] & valid[:, None, :], attn_impl)

    def unpack(values: Tensor) -> list[Tensor]:
        return [values[i, :n] for i, n in enumerate(lengths)]

    return ModelInputs(
        host_to_device(ids, device), host_to_device(positions, device),
        None if mask is None else host_to_device(mask, device), unpack
    )


def build_packed_inputs(
    seqs: list[Tensor], *, attn_impl: str, seq_multiple: int, device: torch.device
) -> ModelInputs:
    """One packed row (1, T) with per-sequence position ids; T is padded to `seq_multiple`."""
    row, layout = seqpack.pack([s.long().cpu() for s in seqs], total_multiple=seq_multiple, pad_value=0)
    mask, kwargs = None, {}
    if attn_impl == SEGMENT_SDPA:  # each sequence with its padding is one segment; the tail is the last
        ends = layout.cu_seqlens_padded.tolist() + ([layout.total_len] if layout.tail_len else [])
        kwargs["cu_seq_lens_q"] = host_to_device(torch.tensor(ends, dtype=torch.int32), device)
        # computed here once per micro-batch: the varlen kernels need it and reading it on the GPU syncs
        kwargs["max_length_q"] = max(b - a for a, b in zip(ends[:-1], ends[1:]))
    elif attn_impl != "flash_attention_2":
        mask = host_to_device(_kernel_mask(seqpack.block_causal_mask(layout)[None], attn_impl), device)

    def unpack(values: Tensor) -> list[Tensor]:
        # position 0 of a packed sequence holds the logprob of its first token given the previous
        # sequence: nothing predicts a first token, so it is 0 by convention (and gets no gradient).
        return [torch.cat([x.new_zeros(1), x[1:]]) for x in seqpack.unpack(values[0], layout)]

    return ModelInputs(host_to_device(row[None], device), host_to_device(layout.position_ids[None], device), mask, unpack,
                       kwargs)


def forward_logprobs(
    model: nn.Module, inputs: ModelInputs, *, temperature: float, with_entropy: bool,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS, top_k: int = 0, top_p: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Token-aligned logprobs (B, S) of `inputs` (and entropies, no grad) from one model forward; top_k / top_p:
    of the sampler's truncated distribution (rl_core.logprobs)."""
    logits = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **inputs.attention_kwargs,
    ).logits  # (B, S, V), or a DTensor sharded on V under TP
    group, vocab_start = None, 0
    if isinstance(logits, DTensor):  # column-parallel lm_head: this rank holds one vocab slice
        mesh = logits.device_mesh
        group = mesh.get_group()
        vocab_start = mesh.get_local_rank() * math.ceil(logits.shape[-1] / mesh.size())  # torch.chunk layout
        logits = logits.to_local()
    # logits at t predict token t+1; the last column predicts nothing and is dropped below
    targets = torch.roll(inputs.input_ids, -1, dims=1)
    next_lp, entropy = vocab_parallel_logprobs(
        logits, targets, vocab_start=vocab_start, group=group, temperature=temperature, chunk_tokens=chunk_tokens,
        with_entropy=with_entropy, top_k=top_k, top_p=top_p,
    )
    logprobs = shift_align(next_lp[:, :-1])  # (B, S), 0 at t = 0
    return logprobs, None if entropy is None else shift_align(entropy[:, :-1])
