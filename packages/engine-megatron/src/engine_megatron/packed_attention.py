"""Megatron's local core attention without a (S, S) score tensor: THD packed rows through seqpack's packed
attention, padded rows through one causal sdpa.

megatron-core's local `DotProductAttention` (the layer spec without Transformer Engine) asserts on
`packed_seq_params`; only TE's attention takes THD. `PackedDotProductAttention` takes it too: megatron's
`SelfAttention` squeezes q/k/v to THD (T, heads, d), applies rope per sequence from the same cu_seqlens
(its unfused THD rope, megatron-core 0.16 and 0.19 alike) and reshapes what the core attention returns to
(T, 1, hidden); this class hands q/k/v and the row's sequence boundaries to
`seqpack.packed_causal_attention`: one varlen kernel call on CUDA in bf16/fp16 (no per-length cuDNN
planning), one causal sdpa per sequence elsewhere (sum L_i^2 scores, never a T x T mask). Padded
micro-batches (no packed_seq_params; megatron's causal mask type, no mask tensor) take one causal sdpa over
(B, heads, S, d): megatron's unfused path keeps (B x heads, S, S) scores of every layer for backward (the
first H100 run: 53.9 GiB peak for Megatron on padded 8192-token micro-batches of the 0.5B shape, against
25.5 GiB for DTensor, whose padded rows go through sdpa). Sliding-window layers, explicit masks and
attention biases keep megatron's implementation. With TE on GPU the TE spec is used instead and this
module is not in it.

Padding: every sequence of a packed row is padded to `pack_multiple` (and the row's tail belongs to the
last sequence), so the segments are `cu_seqlens_q_padded`, as in TE. A sequence's padding comes after its
real tokens, and causal attention keeps it out of their outputs; the padding positions' own outputs are
dropped by the engine (batching.per_sequence).

Rope: megatron's unfused THD rope walks the sequences of the row in Python in every layer (0.16: a slice
per sequence and a cat; 0.19: a whole rope per sequence, 2312 ops for 128 sequences against 15 for one
call, measured on CPU), and megatron's bshd rope takes cos and sin of the frequencies in each call (q and k
of every layer). `use_one_call_thd_rope` replaces it, without context parallelism, by one rope call over
the row with positions that restart at each cu_seqlens entry and cos / sin tables computed once per
micro-batch (same values bit for bit; test_packed_attention).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention
from torch import Tensor

from seqpack import packed_causal_attention

_MEGATRON_THD_ROPE = rope_utils._apply_rotary_pos_emb_thd


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also takes THD packed rows, and runs padded causal rows without (S, S)
    scores (see the module docstring)."""

    def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        # megatron's window is (left, right) inclusive; seqpack's (HF's) counts the query itself
        self.window: int | None = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0:
                raise ValueError(f"window_size={config.window_size}: packed causal attention needs a right "
                                 "window of 0 (causal); set policy.megatron_cfg.window_size=[left, 0]")
            self.window = left + 1
        # apply_query_key_layer_scaling divides softmax_scale by the layer number and megatron's softmax
        # multiplies it back; sdpa applies the whole scale once.
        coeff = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.packed_scale = self.softmax_scale * coeff

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        if packed_seq_params is None:
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            if (attention_mask is None and attention_bias is None and self.softmax_offset is None
                    and self.window is None and mask_type == AttnMaskType.causal):
                return self._padded_causal(query, key, value)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None or self.softmax_offset is not None:
            raise ValueError(f"packed rows take THD packed_seq_params without attention_bias or softmax offsets; got "
                             f"qkv_format={packed_seq_params.qkv_format!r}, softmax_type={self.config.softmax_type!r}")
        cu_seqlens = packed_seq_params.cu_seqlens_q_padded
        if cu_seqlens is None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
        dropout = self.attention_dropout.p if self.training else 0.0
        # query (T, heads, d), key / value (T, query groups, d): megatron's THD layout is seqpack's
        context = packed_causal_attention(query, key, value, cu_seqlens, max_len=packed_seq_params.max_seqlen_q,
                                          scale=self.packed_scale, window=self.window, dropout=dropout)
        return context.reshape(context.shape[0], 1, self.hidden_size_per_partition)  # (T, 1, hidden / TP)

    def _padded_causal(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """query (S, B, heads, d), key / value (S, B, query groups, d) -> (S, B, hidden / TP)."""
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (B, heads, S, d)
        dropout = self.attention_dropout.p if self.training else 0.0
        context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.packed_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)


@functools.cache
def use_one_call_thd_rope() -> None:
    """Route megatron's unfused THD rope (module global `rope_utils._apply_rotary_pos_emb_thd`, looked up
    by `apply_rotary_pos_emb` at call time) through `one_call_thd_rope`; once per process."""
    rope_utils._apply_rotary_pos_emb_thd = functools.partial(one_call_thd_rope, _MEGATRON_THD_ROPE)


def one_call_thd_rope(megatron_thd_rope: Any, t: Tensor, cu_seqlens: Tensor, freqs: Tensor, *,
                      cp_group: Any = None, rotary_interleaved: bool = False, mscale: float = 1.0,
                      **mla_kwargs: Any) -> Tensor:
    """megatron's THD rope of t (T, heads, d) in one call: token i of a sequence starting at s gets
    freqs[i - s]. Its cos / sin tables are computed once per micro-batch (`_token_rope_tables`), not for q
    and k of every layer as megatron's bshd rope does. Context parallelism, multi-latent attention and freqs
    given per row position (megatron-core 0.19 reads freqs of the row's length that way) stay with
    megatron's version, which reads the lengths on the host (a sync on CUDA in every layer); with one
    segment both readings of freqs are the same, so it stays here."""
    per_row_freqs = freqs.shape[0] == t.shape[0] and cu_seqlens.numel() > 2
    if cp_group is None or cp_group.size() != 1 or per_row_freqs or any(mla_kwargs.values()):
        return megatron_thd_rope(t, cu_seqlens, freqs, cp_group=cp_group, rotary_interleaved=rotary_interleaved,
                                 mscale=mscale, **mla_kwargs)
    cos, sin = _token_rope_tables(cu_seqlens, freqs, t.shape[0], t.dtype, mscale)  # (T, 1, rot_dim)
    rot_dim = cos.shape[-1]
    rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
    # megatron's expression (rope_utils._apply_rotary_pos_emb_bshd): the same values, bit for bit
    rotated = rotated * cos + rope_utils._rotate_half(rotated[:, None], rotary_interleaved)[:, 0] * sin
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


# The last micro-batch's tables: (cu_seqlens, freqs, their versions, dtype, mscale, cos, sin)
_last_tables: tuple | None = None


def _token_rope_tables(cu_seqlens: Tensor, freqs: Tensor, total: int, dtype: torch.dtype,
                       mscale: float) -> tuple[Tensor, Tensor]:
    """cos and sin of every token's frequencies, (total, 1, rot_dim) in `dtype`, as megatron rounds them.
    Reused while the same cu_seqlens and freqs tensors come back unchanged (q and k of every layer of a
    forward, and its backward holds them); inference tensors, which have no version counter, every time."""
    global _last_tables
    cacheable = not (cu_seqlens.is_inference() or freqs.is_inference())
    key = (cu_seqlens._version, freqs._version, total, dtype, mscale) if cacheable else None
    last = _last_tables
    if key is not None and last is not None and last[0] is cu_seqlens and last[1] is freqs and last[2] == key:
        return last[3], last[4]
    starts = torch.repeat_interleave(cu_seqlens[:-1], torch.diff(cu_seqlens), output_size=total)  # (T,)
    token_freqs = freqs[torch.arange(total, device=freqs.device) - starts][:, 0]  # (T, 1, rot_dim)
    cos = (torch.cos(token_freqs) * mscale).to(dtype)
    sin = (torch.sin(token_freqs) * mscale).to(dtype)
    _last_tables = (cu_seqlens, freqs, key, cos, sin) if cacheable else None
    return cos, sin
