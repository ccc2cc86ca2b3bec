"""Paged attention: the pure-PyTorch reference (CPU path and test oracle) and, on CUDA, our kernel."""
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([num_tokens, num_kv_heads, head_dim]) into the paged cache
    ([num_blocks, block_size, num_kv_heads, head_dim]) at its slot = block_id * block_size + offset.
    Slot -1 marks padding and is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # Viewing the cache as [num_slots, heads, dim] turns the slot into a plain row index.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Blocks `blocks` (lane after lane, equally many each) as [num_seqs, tokens, kv_heads, dim].
    A block is one contiguous row, so this is a row index_select: a memcpy per block, several
    times faster on CPU than advanced indexing."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks).view(num_seqs, -1, *cache.shape[2:])


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """The first max_len cached tokens of each lane, in order: [num_seqs, max_len, kv_heads, dim].
    Unused block-table entries must point at a real block (0 is fine); the caller masks them."""
    num_blocks = (max_len + cache.shape[1] - 1) // cache.shape[1]
    return _gather_blocks(cache, block_tables[:, :num_blocks].flatten(), block_tables.shape[0])[:, :max_len]


@dataclass
class DecodePlan:
    """The part of decode attention that depends only on the block tables, the same in every layer:
    made once per step (plan_decode) instead of once per layer."""
    blocks: torch.Tensor  # [num_seqs * blocks_per_seq] block ids to gather, lane after lane
    max_len: int          # tokens gathered per lane: whole blocks, so that K stays a plain matrix
    bias: torch.Tensor    # [num_seqs, 1, max_len] in the cache's dtype: 0 on a lane's tokens, -inf on the padding
    spread: torch.Tensor  # [1, kv_heads, 1, kv_heads, 1]: the identity, to lay query heads out wide


def plan_decode(block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor) -> DecodePlan:
    # Whole blocks: a length that is not a multiple of the block size would leave the gathered K a
    # strided slice, which the matmul in paged_attention first copies (measured 3x slower).
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-int(context_lens.max()) // block_size)
    max_len = num_blocks * block_size
    pad = torch.arange(max_len, device=k_cache.device) >= context_lens.to(k_cache.device)[:, None]
    bias = torch.zeros(pad.shape, dtype=k_cache.dtype, device=pad.device).masked_fill_(pad, float("-inf"))[:, None, :]
    spread = torch.eye(kv_heads, dtype=k_cache.dtype, device=k_cache.device).view(1, kv_heads, 1, kv_heads, 1)
    return DecodePlan(block_tables[:, :num_blocks].flatten(), max_len, bias, spread)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    plan: DecodePlan | None = None) -> torch.Tensor:
    """Decode attention, one query token per lane: query [num_seqs, num_heads, head_dim] attends
    to its lane's first context_lens[i] cached tokens (its own included). Returns query's shape.
    All lanes run as one padded batch; pad keys are masked out, and since the cache is
    zero-initialised they cannot leak NaN/inf into the weighted sum. `plan`: plan_decode's
    result for these block tables, when the caller has it."""
    seqs, heads, dim = query.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    plan = plan or plan_decode(block_tables, context_lens, k_cache)
    k = _gather_blocks(k_cache, plan.blocks, seqs).flatten(2)  # [seqs, max_len, kv_heads * dim]
    v = _gather_blocks(v_cache, plan.blocks, seqs).flatten(2)
    # Grouped-query attention without copying K/V per head or per group: each query head is laid out
    # across all kv_heads * dim columns, zero outside its own KV head's slice (a product with the
    # identity, exact), so one batched matmul with the lane's keys as they were gathered gives every
    # head its scores. It spends kv_heads x the (small) attention FLOPs to save the transposing
    # copies of K and V that dominate on CPU.
    q = (query.view(seqs, kv_heads, group, 1, dim) * plan.spread).view(seqs, heads, kv_heads * dim)
    # Scale and pad mask ride in the matmul, and softmax runs in the cache's dtype (it widens to
    # float32 inside): two passes over the scores fewer than a float32 add, softmax and narrowing,
    # and the same bits where the scale is a power of two (head_dim 64), else within a rounding.
    probs = torch.baddbmm(plan.bias, q, k.transpose(1, 2), alpha=scale).softmax(-1)
    # The same trick backwards: head h's output is the slice of its row that belongs to its KV head.
    out = torch.bmm(probs, v).view(seqs, kv_heads, group, kv_heads, dim).diagonal(dim1=1, dim2=3)
    return out.permute(0, 3, 1, 2).reshape(seqs, heads, dim)


def paged_attention_varlen(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float,
                           decode: Callable = paged_attention) -> torch.Tensor:
    """Causal attention for a flattened batch of lanes. Lane i owns query rows
    query_start_loc[i]:query_start_loc[i+1] ([total_tokens, num_heads, head_dim]); they are the
    last q_len of its context_lens[i] tokens, so row j sits at position context_len - q_len + j
    and sees keys 0..that position, through the lane's block table and nothing else.
    One-token lanes go to `decode` together (the CUDA kernel on GPU), longer ones to SDPA."""
    starts = query_start_loc.tolist()
    ctx = context_lens.tolist()
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    one = [i for i, n in enumerate(q_lens) if n == 1]
    out = torch.empty_like(query)
    if one:
        idx = torch.tensor(one, device=query.device)
        rows = query_start_loc.to(query.device)[idx].long()
        out[rows] = decode(query[rows], k_cache, v_cache, block_tables[idx], context_lens[idx], scale)
    for i, n in enumerate(q_lens):
        if n == 1:
            continue
        s = starts[i]
        k = gather_kv(k_cache, block_tables[i:i + 1], ctx[i]).transpose(1, 2)  # [1, kv_heads, ctx, dim]
        v = gather_kv(v_cache, block_tables[i:i + 1], ctx[i]).transpose(1, 2)
        q = query[s:s + n].unsqueeze(0).transpose(1, 2)
        if n == ctx[i]:  # a whole prompt in one chunk: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # a later chunk: query j sits at position ctx - n + j and sees keys up to it
            pos = torch.arange(ctx[i] - n, ctx[i], device=query.device)
            mask = torch.arange(ctx[i], device=query.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


_SOURCES = ["binding.cpp", "paged_attention.cu"]
_CXX_FLAGS = ["-O3"]  # torch adds the C++ standard it needs (C++20 for torch 2.13)
_NVCC_FLAGS = ["-O3", "-lineinfo"]
_ext = None


def _kernels():
    """The compiled kernels: the module setup.py built ahead of time if there is one, else built on
    first use with ninja into torch's extension cache (TORCH_EXTENSIONS_DIR, default
    ~/.cache/torch_extensions) for the GPUs present (or TORCH_CUDA_ARCH_LIST); later runs reuse it
    until the sources or flags change."""
    global _ext
    if _ext is None:
        try:
            from . import _C as _ext
        except ImportError:
            from torch.utils.cpp_extension import load
            here = os.path.dirname(os.path.abspath(__file__))
            try:
                _ext = load("laneserve_attention", [os.path.join(here, s) for s in _SOURCES],
                            extra_cflags=_CXX_FLAGS, extra_cuda_cflags=_NVCC_FLAGS)
            except Exception as e:
                _ext = RuntimeError(  # kept, so that later calls fail at once with the same message
                    f"could not build the CUDA paged-attention kernel ({type(e).__name__}: {e}). Building "
                    "needs a CUDA build of torch, the CUDA toolkit (nvcc; CUDA_HOME if not on PATH) of a "
                    "matching version, a C++ compiler and ninja. The pure-PyTorch path needs none of "
                    "that and still works: attention_cuda.paged_attention/store_kv, and running on CPU.")
                _ext.__cause__ = e
    if isinstance(_ext, Exception):
        raise _ext
    return _ext


def cuda_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention on CUDA tensors, by the kernel: same arguments, same result (a new
    contiguous tensor). head_dim 64 or 128, block_size 8, 16 or 32, float32/float16/bfloat16,
    block_tables and context_lens int32 on the same GPU; errors otherwise. Runs on the current stream."""
    with torch.cuda.device(query.device if query.is_cuda else -1):
        return _kernels().paged_attention(query, k_cache, v_cache, block_tables, context_lens, float(scale),
                                          torch.cuda.current_stream().cuda_stream)


def cuda_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv on CUDA tensors, by the kernel (slot_mapping int64, -1 skipped). Current stream."""
    with torch.cuda.device(key.device if key.is_cuda else -1):
        _kernels().store_kv(key, value, k_cache, v_cache, slot_mapping, torch.cuda.current_stream().cuda_stream)


def cuda_extension():
    """For setup.py: the kernels as a CUDAExtension `attention_cuda._C` (paths relative to the
    repository root), which _kernels() then imports instead of building; None without nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension
    if CUDA_HOME is None:
        return None
    return CUDAExtension("attention_cuda._C", [os.path.join("attention_cuda", s) for s in _SOURCES],
                         extra_compile_args={"cxx": _CXX_FLAGS, "nvcc": _NVCC_FLAGS})
