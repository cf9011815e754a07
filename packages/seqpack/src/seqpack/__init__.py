"""seqpack: turn variable-length sequences into dense work for training engines.

- `pack_bins` (binpack): FFD / MFFD / BFD / concat bin packing of lengths into a token capacity.
- `balance_partitions` (balance): Karmarkar-Karp or greedy split of sequences over DP ranks.
- `pack`, `pack_like`, `unpack`, `block_causal_mask`, `PackedLayout` (layout): packed rows with cu_seqlens,
  restarting position ids, seq ids and a block-diagonal causal mask.
- `cp_shard_indices`, `cp_shard`, `cp_gather` (context_parallel): megatron's 2*CP-chunk load-balanced split.
- `plan_micro_batches`, `MicroBatchPlan` (microbatch): token-budget micro-batching, padded or packed;
  `plan_dp_micro_batches`: the same, with the same micro-batch count on every DP rank (both engines).
- `round_up` (layout): the one rounding rule of every padded length.
- `packed_causal_attention` (attention): causal attention within each sequence of a packed row (a varlen
  kernel on CUDA in half precision, one sdpa per sequence elsewhere).
"""

from .attention import packed_causal_attention
from .balance import balance_partitions, partition_spread
from .binpack import pack_bins
from .context_parallel import cp_gather, cp_shard, cp_shard_indices
from .layout import PackedLayout, block_causal_mask, build_layout, pack, pack_like, round_up, unpack
from .microbatch import MicroBatchPlan, micro_batch_cost, plan_dp_micro_batches, plan_micro_batches

__all__ = [
    "MicroBatchPlan",
    "PackedLayout",
    "balance_partitions",
    "block_causal_mask",
    "build_layout",
    "cp_gather",
    "cp_shard",
    "cp_shard_indices",
    "micro_batch_cost",
    "packed_causal_attention",
    "pack",
    "pack_bins",
    "pack_like",
    "partition_spread",
    "plan_dp_micro_batches",
    "plan_micro_batches",
    "round_up",
    "unpack",
]
