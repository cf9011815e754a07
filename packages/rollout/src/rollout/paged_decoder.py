"""The forward pass of a Hugging Face decoder over rollout's paged KV cache, with static-shape decode steps.

`PagedDecoder` walks the HF model's own modules (embeddings, norms, projections, MLP, rotary embedding),
so it shares the model's weight storage: `update_weights` copies into the same tensors and nothing else
needs to change, captured CUDA graphs included. Supported: Llama-style decoders with full attention on
every layer (llama, qwen2, qwen3 with q/k norms, mistral without a sliding window).

- prefill: several prompts in one packed forward (tokens concatenated, `cu_seqlens`), attention through
  `seqpack.packed_causal_attention` (a varlen kernel on CUDA half precision, one causal sdpa per prompt
  elsewhere), each prompt's K/V written to its blocks, last-position logits per prompt;
- decode: one token for each of `b` rows, padded to a batch-size bucket (the smallest bucket >= b) so the
  step has static shapes. Inputs are static buffers (tokens, positions, block tables, sampling keys and
  step counters); attention gathers each row's blocks into (bucket, kv_heads, width * block_size, head_dim)
  and runs sdpa with a length mask; the step ends with sampling (rollout.sampling.sample_next), so its
  outputs are the sampled tokens (bucket,) and their logprobs (bucket,), never the (bucket, V) logits.
  On CUDA each (bucket, width, sampling parameters) step is captured once in a CUDA graph and replayed;
  elsewhere it runs eagerly (same shapes, same code).
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rl_core.interfaces import SamplingParams
from rollout.paged_cache import NULL_BLOCK, PagedKVCache
from rollout.sampling import sample_next, sampling_key
from seqpack.attention import packed_causal_attention

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512)


# The architectures whose decoder layer is the one `_forward` computes (pre-norm attention and MLP, rotary on every
# layer, Qwen3's q/k norms), each checked against HF's forward. A layout check alone let others through that have the
# same module names and more math (Granite's multipliers, GLM-4's post-norms, OLMo's clip_qkv, SmolLM3's layers
# without rope): sampled from another model, with no error, and decode=auto chose paged for them on every GPU.
PAGED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(model: Any) -> str | None:
    """Why PagedDecoder cannot run `model` (None if it can). Reads only the config and the module layout, so a
    model on the meta device answers as well as a loaded one."""
    config = model.config
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if inner is None or any(not hasattr(inner, n) for n in needed) or layer_types != {"full_attention"} \
            or sliding is not None or not hasattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb"):
        return (f"the paged decode path supports Llama-style decoders with full attention on every layer; "
                f"{type(model).__name__} (layer types {sorted(layer_types)}, sliding_window={sliding}) is not one")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # its MLP step takes the dense path's 3-D hidden states, not the packed 2-D rows
        return (f"the paged decode path runs dense MLPs; {type(model).__name__} has mixture-of-experts layers "
                f"({experts} experts)")
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if rope_type in ("dynamic", "longrope"):  # frequencies from the batch's longest position, read on the host
        return (f"the paged decode path needs rotary frequencies that do not depend on the sequence length; "
                f"{type(model).__name__} uses rope_type={rope_type!r}, which reads the longest position on the host "
                f"in every step (not capturable in a CUDA graph)")
    if getattr(config, "model_type", None) not in PAGED_MODEL_TYPES:
        return (f"the paged decode path computes the decoder layers of {list(PAGED_MODEL_TYPES)}; "
                f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) is not one of them")
    return None


class PagedDecoder:
    """Prefill and static-shape decode steps of `model` over a `PagedKVCache`."""

    def __init__(self, model: Any, *, block_size: int = 16, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 cuda_graphs: bool = True) -> None:
        problem = unsupported(model)
        if problem:
            raise ValueError(f"{problem}. Build TorchGenerationBackend with decode='dense'")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"batch_buckets={list(buckets)}; expected positive batch sizes")
        self.model, self.inner = model, model.model
        self.block_size = block_size
        self.buckets = sorted(set(int(b) for b in buckets))
        self.cuda_graphs = cuda_graphs
        self._rope = sys.modules[type(model).__module__].apply_rotary_pos_emb
        attn = self.inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = model.config.num_key_value_heads
        self.cache: PagedKVCache | None = None
        self._graphs: dict[tuple[int, int, tuple[float, int, float]], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self._pool: Any = None
        self.graph_captures = 0  # how many graphs were captured (tests: refit must not add any)

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    # ------------------------------------------------------------------ memory
    def reserve(self, *, num_blocks: int, max_rows: int, table_width: int) -> None:
        """Make sure the cache holds `num_blocks` blocks and the step buffers fit max_rows x table_width.

        Reallocating (only when a call needs more) drops captured graphs: they hold the old addresses.
        """
        cache, dev = self.cache, self.device
        rows = self.bucket_for(max_rows)
        if cache is not None and cache.num_blocks >= num_blocks and self.tables.shape[0] >= rows \
                and self.tables.shape[1] >= table_width and cache.k.device == dev:
            return
        if cache is not None:
            num_blocks = max(num_blocks, cache.num_blocks)
            rows, table_width = max(rows, self.tables.shape[0]), max(table_width, self.tables.shape[1])
        self.release()
        weight = self.inner.embed_tokens.weight
        self.cache = PagedKVCache(num_layers=len(self.inner.layers), num_blocks=num_blocks,
                                  block_size=self.block_size, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  dtype=weight.dtype, device=dev)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.tables = torch.full((rows, table_width), NULL_BLOCK, dtype=torch.int64, device=dev)
        self.keys = torch.zeros(rows, dtype=torch.int64, device=dev)  # rollout.sampling.row_keys of each row
        self.steps = torch.zeros(rows, dtype=torch.int64, device=dev)  # tokens each row has sampled so far
        logger.info("paged KV cache: %d blocks x %d positions (%.1f MiB), step buffers %d rows x %d blocks",
                    num_blocks, self.block_size, 2 * self.cache.k.numel() * self.cache.k.element_size() / 2**20,
                    rows, table_width)

    def release(self) -> None:
        """Free the KV cache, the step buffers and the captured graphs (sleep)."""
        self.cache, self._graphs, self._pool = None, {}, None
        self.tokens = self.positions = self.tables = self.keys = self.steps = None  # type: ignore[assignment]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def _use_graphs(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def bucket_for(self, rows: int) -> int:
        """The smallest bucket >= rows (rows itself beyond the largest bucket)."""
        return next((b for b in self.buckets if b >= rows), rows)

    # ------------------------------------------------------------------ forward pieces
    def _attention_inputs(self, layer: Any, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (T, H, D), k / v (T, H_kv, D) of tokens x (T, hidden), rotary embedding applied."""
        attn = layer.self_attn
        t = x.shape[0]
        q = attn.q_proj(x).view(t, -1, self.head_dim)
        k = attn.k_proj(x).view(t, -1, self.head_dim)
        v = attn.v_proj(x).view(t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rope(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def _layers(self, ids: Tensor, positions: Tensor, slots: Tensor, attend: Any) -> Tensor:
        """Hidden states (T, hidden) after every layer; `attend(layer_idx, q, k, v) -> (T, H * D)`."""
        x = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(x, positions[None])
        cos, sin = cos[0], sin[0]  # (T, D)
        for i, layer in enumerate(self.inner.layers):
            q, k, v = self._attention_inputs(layer, layer.input_layernorm(x), cos, sin)
            self.cache.write(i, slots, k, v)
            x = x + layer.self_attn.o_proj(attend(i, layer.self_attn, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.inner.norm(hidden))

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[list[int]], tables: Sequence[list[int]]) -> Tensor:
        """Write the K/V of each prompt into its blocks `tables[i]` in one packed forward; returns the last
        position's logits of each prompt (P, V)."""
        dev = self.device
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)  # (T,)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        slots = torch.cat([self.cache.slots(table, 0, n) for table, n in zip(tables, lengths)]).to(dev)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)  # (P+1,)

        def packed_attention(i: int, attn: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            # lengths from the host: cu_seqlens is an inference tensor, read again in every layer otherwise (fp32)
            out = packed_causal_attention(q, k, v, cu_seqlens, max_len=max(lengths), scale=attn.scaling,
                                          lengths=lengths)
            return out.reshape(q.shape[0], -1)  # (T, H * D)

        hidden = self._layers(ids, positions, slots, packed_attention)
        return self._logits(hidden[cu_seqlens[1:].long() - 1])

    def _step_logits(self, bucket: int, width: int) -> Tensor:
        """The logits (bucket, V) of one static-shape decode step over the first `bucket` rows of the step
        buffers (its K/V written to the cache)."""
        tokens, positions = self.tokens[:bucket], self.positions[:bucket]
        tables = self.tables[:bucket, :width]
        bs = self.block_size
        slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        # (bucket, 1, 1, width * bs): row r sees positions 0..positions[r] (its own new token included).
        visible = (torch.arange(width * bs, device=tokens.device)[None, :] <= positions[:, None])[:, None, None]

        def paged_attention(i: int, attn: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys, values = self.cache.gather(i, tables)  # (bucket, H_kv, width * bs, D)
            # One query token per row: the query heads of a K/V group become that group's "query length"
            # (head h uses K/V head h // group, as repeat_kv does), so GQA needs no K/V head copies.
            grouped = q.view(bucket, self.kv_heads, -1, self.head_dim)  # (bucket, H_kv, group, D)
            out = torch.nn.functional.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=visible, scale=attn.scaling)  # (bucket, H_kv, group, D)
            return out.reshape(bucket, -1)

        return self._logits(self._layers(tokens, positions, slots, paged_attention))

    def _decode_step(self, bucket: int, width: int, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """One static-shape decode step, sampling included: next tokens (bucket,) and their logprobs."""
        logits = self._step_logits(bucket, width)
        return sample_next(logits, params, keys_B=self.keys[:bucket], steps_B=self.steps[:bucket])

    @torch.inference_mode()
    def decode(self, tokens: Tensor, positions: Tensor, tables: Tensor, keys: Tensor, steps: Tensor,
               params: SamplingParams) -> tuple[Tensor, Tensor]:
        """The next token (b,) of b rows and its logprob (b,): last tokens (b,), their positions (b,), block
        tables (b, M), sampling keys (b,) and the tokens each row has sampled (b,: the draw's step counter).

        Inputs (the scheduler's CPU bookkeeping) are copied into the static buffers."""
        rows = tables.shape[0]
        bucket = self.bucket_for(rows)
        # Attend over the blocks the longest row uses, not the whole table (rounded to a power of two
        # when graphs are captured, so that few (bucket, width) graphs exist).
        width = int(positions.max()) // self.block_size + 1
        if self._use_graphs:
            width = min(1 << (width - 1).bit_length(), tables.shape[1])
        tables = tables[:, :width]
        self.tokens[:rows].copy_(tokens, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.tables[:rows, :width].copy_(tables, non_blocking=True)
        self.keys[:rows].copy_(keys, non_blocking=True)
        self.steps[:rows].copy_(steps, non_blocking=True)
        if bucket > rows:  # padding rows: token 0 at position 0 of the null block, which no real row reads
            for buffer, fill in ((self.tokens, 0), (self.positions, 0), (self.tables, NULL_BLOCK), (self.keys, 0),
                                 (self.steps, 0)):
                buffer[rows:bucket] = fill
        if not self._use_graphs:
            next_tokens, logprobs = self._decode_step(bucket, width, params)
        else:
            next_tokens, logprobs = self._replay(bucket, width, params)
        return next_tokens[:rows], logprobs[:rows]

    def _replay(self, bucket: int, width: int, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """Run the captured graph of (bucket, width, sampling parameters), capturing it on first use."""
        key = (bucket, width, sampling_key(params))
        if key not in self._graphs:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, cuBLAS handles)
                self._decode_step(bucket, width, params)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                next_tokens, logprobs = self._decode_step(bucket, width, params)
            self._graphs[key] = (graph, next_tokens, logprobs)
            self.graph_captures += 1
            logger.info("captured the decode step of %d rows x %d blocks (sampling %s) in a CUDA graph", bucket,
                        width, key[2])
        graph, next_tokens, logprobs = self._graphs[key]
        graph.replay()
        return next_tokens, logprobs
