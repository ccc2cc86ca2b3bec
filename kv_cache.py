"""Paged KV memory: physical K/V blocks per layer, the block pool, and each lane's block table.

A lane's token at position p lives in block block_table[p // block_size], row p % block_size:
physical slot = block_id * block_size + p % block_size. Blocks are handed out when a lane
first needs them and all return to the pool the moment the lane finishes."""
from collections import deque

import torch

from model import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    # K and V, every layer, every KV head.
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * config.head_dim * torch.finfo(dtype).bits // 8)


class KVCache:
    """The physical tensors: per layer, k and v of shape [num_blocks, block_size, kv_heads, head_dim].
    Zero-initialised so that masked-out padding reads in attention are finite."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.layers = [(torch.zeros(shape, dtype=dtype, device=device),
                        torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(config.num_hidden_layers)]


class BlockManager:
    """The pool of block ids with a free list and reference counts (a block shared by several
    lanes through prefix caching is freed only when its last user lets go)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a lane holding block_table needs to cache num_tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self.free_blocks)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow block_table in place to cover num_tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(block_table, num_tokens)):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        block_table.clear()

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Physical slots of positions start..end-1 of the lane owning block_table."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]
