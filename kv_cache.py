"""Paged KV memory: physical K/V blocks per layer, the block pool, each sequence's block table,
the opt-in prefix cache, and swap space on the host.

A sequence's token at position p lives in block block_table[p // block_size], row p % block_size:
physical slot = block_id * block_size + p % block_size. Blocks are handed out when a sequence
first needs them and return to the pool the moment the sequence finishes."""

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from attention_cuda import QMAX

# --kv-cache-dtype's types (auto: the model's dtype): 8-bit codes, or bfloat16 (beside float32 on a CPU)
KV_CACHE_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "bfloat16": torch.bfloat16,
}


@dataclass
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        # K and V, every layer, every KV head; an 8-bit cache's float32 scale per token and KV head included.
        per_head = self.head_dim * dtype.itemsize + (4 if dtype in QMAX else 0)
        return 2 * self.num_layers * block_size * self.num_kv_heads * per_head

    def tensors(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> list[tuple[tuple, torch.dtype]]:
        """A layer's cache tensors as (shape, dtype): k and v, then for an 8-bit dtype (a key of attention_cuda.QMAX)
        k_scale and v_scale, one float32 per token and KV head in the same paged layout."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [(shape, dtype)] * 2 + ([(shape[:3], torch.float32)] * 2 if dtype in QMAX else [])


def slots(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Physical slots of positions start..end-1 of the sequence owning block_table."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class KVCache:
    """The physical tensors: per layer, k and v of shape [num_blocks, block_size, kv_heads, head_dim] (an 8-bit
    cache's codes, then k_scale and v_scale: see KVShape.tensors), plus the same layout on the host for
    swapped-out sequences. The device's are zero-initialised so that masked-out padding reads in attention are
    finite; the host's are not: a swap-in reads only whole blocks a swap-out wrote, so on CPU the swap space
    (4 GiB by default) takes memory only as sequences are swapped out (pinned memory for a GPU is locked at once).
    The swap space is one allocation of bytes, viewed per layer and tensor: torch's pinned-memory allocator rounds
    each allocation up to a power of two, which would lock up to twice the swap space if every layer's K and V
    were allocated on their own."""

    def __init__(
        self,
        kv: KVShape,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_swap_blocks: int = 0,
    ):
        specs = kv.tensors(num_blocks, block_size, dtype)
        self.layers = [tuple(torch.zeros(s, dtype=d, device=device) for s, d in specs) for _ in range(kv.num_layers)]
        self.pinned = torch.device(device).type == "cuda"  # pinned pages make the copies asynchronous DMA
        self.host = []
        if num_swap_blocks:  # one allocation (see above), every layer's tensors in turn, each 64-byte aligned
            host = kv.tensors(num_swap_blocks, block_size, dtype) * kv.num_layers
            sizes = [math.prod(s) * d.itemsize for s, d in host]
            padded = [-(-n // 64) * 64 for n in sizes]
            parts = torch.empty(sum(padded), dtype=torch.uint8, pin_memory=self.pinned).split(padded)
            views = [p[:n].view(d).view(s) for p, n, (s, d) in zip(parts, sizes, host)]
            self.host = [tuple(views[i : i + len(specs)]) for i in range(0, len(views), len(specs))]

    def swap(self, out: list[tuple[int, int]], back: list[tuple[int, int]]) -> None:
        """Copy (device block -> host block) pairs out, then (host block -> device block) pairs in.
        Out goes first: a device block freed by a swap-out may be the target of a swap-in."""
        for pairs, to_host in ((out, True), (back, False)):
            if not pairs:
                continue
            src, dst = (torch.tensor(p, pin_memory=self.pinned) for p in zip(*pairs))
            on_device = (src if to_host else dst).to(self.layers[0][0].device, non_blocking=self.pinned)
            for dev_kv, host_kv in zip(self.layers, self.host):
                for d, h in zip(dev_kv, host_kv):
                    d, h = d.view(torch.uint8), h.view(torch.uint8)  # bytes: torch lacks some float8 indexing
                    if to_host:
                        h[dst] = d[on_device].to("cpu")
                    else:
                        # Gathered into pinned memory (h[src] would be a pageable copy), so that the
                        # copy to the device is asynchronous.
                        staged = torch.empty((len(src), *h.shape[1:]), dtype=h.dtype, pin_memory=self.pinned)
                        torch.index_select(h, 0, src, out=staged)
                        d[on_device] = staged.to(d.device, non_blocking=self.pinned)


def chain_root(cache_salt: str | None) -> bytes:
    """h_{-1} of a sequence's key chain: b"" without a salt, else the salt's digest (32 bytes, so no chain of
    token ids alone can meet a salted one): only sequences of equal salts share blocks."""
    return b"" if cache_salt is None else hashlib.sha256(cache_salt.encode()).digest()


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix-cache key of a full block: h_i = SHA-256(h_{i-1} + its token ids), h_{-1} = chain_root, so a
    key names the whole prefix. Cryptographic, because a collision would serve one request's KV to
    another, and Python's hash can be made to collide on purpose (from 3.12 hash(None) is a constant)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """A pool of block ids: an LRU-ordered free list and reference counts. With prefix caching, every full block
    of a prompt is published under its block_key, which names its whole prefix. A new sequence whose prompt starts
    with the same blocks shares them (ref count + 1) instead of recomputing them. Blocks of generated tokens are
    neither published nor shared: on CPU a prompt token's attention is computed otherwise than a generated one's
    (cpu.BucketedAttention), so they would not hold what another sequence's prompt computes at those positions.
    Freed blocks keep their content and key until the pool hands them out again, oldest-freed first."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # block_key -> block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """How many more blocks a sequence holding block_table needs to cache num_tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self.free_blocks)

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow block_table in place to cover num_tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(block_table, num_tokens)):
            block, _ = self.free_blocks.popitem(last=False)
            if self.cached.get(self.block_hash[block]) == block:  # reusing a freed block evicts its cached prefix
                del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
            self.ref_counts[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        # Tail blocks first, so they are evicted before the prefix blocks more sequences can share.
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        block_table.clear()

    def match_prefix(self, block_table: list[int], token_ids: list[int], cache_salt: str | None = None) -> int:
        """Share the cached full blocks that start token_ids into an empty block_table; returns
        how many tokens they cover. The block holding the last token is never shared: that token
        is always computed, for its logits, and a sequence must never write into a shared block."""
        if not self.enable_prefix_caching:
            return 0
        bs, h = self.block_size, chain_root(cache_salt)
        for i in range((len(token_ids) - 1) // bs):
            h = block_key(h, token_ids[i * bs : (i + 1) * bs])
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            block_table.append(block)
        return len(block_table) * bs

    def publish(
        self, block_table: list[int], token_ids: list[int], start: int, end: int, cache_salt: str | None = None
    ) -> None:
        """Key the blocks that computing prompt tokens start..end-1 has just filled."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(start // bs, end // bs):
            block = block_table[i]
            parent = self.block_hash[block_table[i - 1]] if i else chain_root(cache_salt)
            if self.block_hash[block] is not None or parent is None:
                continue  # already keyed (shared), or its prefix is unknown (swapped back in)
            h = self.block_hash[block] = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            self.cached.setdefault(h, block)  # a twin computed by another sequence keeps the entry
