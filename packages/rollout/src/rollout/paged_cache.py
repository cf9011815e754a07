"""A preallocated, paged KV cache: fixed-size blocks handed out from a free list, shared by reference count.

Storage is one tensor per K and V, `(layers, num_blocks, block_size, kv_heads, head_dim)`, allocated once
and written in place, so its address never changes (CUDA graphs read it). A sequence owns a block table
(the ids of its blocks, in order); position `p` of the sequence lives in block `table[p // block_size]`
at offset `p % block_size`. Block 0 is never handed out: padding rows of a static-shape decode step point
at it and write their garbage there.

Prefix sharing: the n samples of a prompt reference the prompt's full blocks (refcount + 1 each) and get
a private copy of its partial last block (copy on write happens once, at admission). A block goes back to
the free list when its last reference is released.
"""

from __future__ import annotations

import torch
from torch import Tensor

NULL_BLOCK = 0


class BlockAllocator:
    """Free list + reference counts over block ids 1..num_blocks-1 (block 0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged KV cache needs at least 2 blocks (one is the null block); got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, 0, -1))  # pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks with refcount 1; raises RuntimeError when the free list is too short."""
        if count > len(self.free_blocks):
            raise RuntimeError(f"paged KV cache: {count} blocks requested, {len(self.free_blocks)} free")
        blocks = [self.free_blocks.pop() for _ in range(count)]
        for b in blocks:
            self.refcount[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to each (already allocated) block."""
        for b in blocks:
            if self.refcount[b] < 1:
                raise RuntimeError(f"paged KV cache: block {b} is shared but not allocated")
            self.refcount[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks nobody references go back to the free list."""
        for b in blocks:
            if self.refcount[b] < 1:
                raise RuntimeError(f"paged KV cache: block {b} released more often than referenced")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free_blocks.append(b)


class PagedKVCache:
    """K/V storage of every layer in blocks of `block_size` positions, plus the block allocator."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        if block_size < 1:
            raise ValueError(f"paged KV cache block_size={block_size}; expected >= 1")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def free_all(self) -> None:
        """Every block back on the free list (what a generate call that failed midway left allocated)."""
        self.allocator = BlockAllocator(self.allocator.num_blocks)

    def blocks_for(self, num_positions: int) -> int:
        """Blocks needed to hold `num_positions` positions."""
        return -(-num_positions // self.block_size)

    def slots(self, table: list[int], start: int, end: int) -> Tensor:
        """Flat slot ids (block * block_size + offset) of positions [start, end) of a sequence (CPU int64)."""
        pos = torch.arange(start, end)
        return torch.tensor(table, dtype=torch.int64)[pos // self.block_size] * self.block_size \
            + pos % self.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (the copy-on-write of a shared partial block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k / v (N, kv_heads, head_dim) of one layer at flat `slots` (N,)."""
        flat_shape = (-1, *self.k.shape[3:])
        self.k[layer].view(flat_shape).index_copy_(0, slots, k)
        self.v[layer].view(flat_shape).index_copy_(0, slots, v)

    def gather(self, layer: int, table: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of one layer for block tables (B, M) -> two (B, kv_heads, M * block_size, head_dim)."""
        b, m = table.shape
        k = self.k[layer][table].reshape(b, m * self.block_size, *self.k.shape[3:])
        v = self.v[layer][table].reshape(b, m * self.block_size, *self.v.shape[3:])
        return k.transpose(1, 2), v.transpose(1, 2)
