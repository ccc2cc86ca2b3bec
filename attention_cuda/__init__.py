"""Paged attention: the pure-PyTorch reference (the test oracle; prefill on every device) and our CUDA
kernel for decode. cpu.py holds a faster CPU form of both, tested against the reference."""
import glob
import os
from typing import Callable

import torch
import torch.nn.functional as F


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([num_tokens, kv_heads, dim]) into the paged cache ([num_blocks, block_size,
    kv_heads, dim]) at its slot = block_id * block_size + offset; slot -1 (padding) is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # Viewing the cache as [num_slots, heads, dim] turns the slot into a plain row index.
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """One sequence's first num_tokens cached tokens, in order: [num_tokens, kv_heads, dim]. Token t
    lives in block block_table[t // block_size], row t % block_size."""
    t = torch.arange(num_tokens, device=cache.device)
    return cache[block_table.to(cache.device)[t // cache.shape[1]].long(), t % cache.shape[1]]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, max_context_len: int | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence: query [num_seqs, num_heads, head_dim] attends to its
    sequence's first context_lens[i] cached tokens (its own included) alone; query head h reads KV head
    h // (num_heads / num_kv_heads) (grouped-query attention). In float32 (float64 stays float64), sequence by
    sequence; returns query's shape and dtype (zeros for context 0). max_context_len: for the kernel's signature."""
    group = query.shape[1] // k_cache.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        k, v = (gather_kv(c, block_tables[i], n).to(acc).repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
        scores = torch.einsum("hd,nhd->hn", query[i].to(acc), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out


def paged_attention_varlen(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, query_lens: list[int],
                           host_context_lens: list[int], scale: float,
                           decode: Callable = paged_attention) -> torch.Tensor:
    """Causal attention for a flattened batch of sequences. Sequence i owns the next query_lens[i] rows of query
    ([total_tokens, num_heads, head_dim]), the last of its context_lens[i] tokens: row j sits at position
    context_len - q_len + j and sees keys 0..that position of its sequence alone. The leading one-token sequences
    go to `decode` together (the CUDA kernel on GPU), the rest to SDPA. query_lens, host_context_lens: host lists."""
    ones = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
    out = torch.empty_like(query)
    if ones:
        out[:ones] = decode(query[:ones], k_cache, v_cache, block_tables[:ones], context_lens[:ones], scale,
                            max(host_context_lens[:ones]))
    s = ones
    for i in range(ones, len(query_lens)):
        n, ctx = query_lens[i], host_context_lens[i]
        k = gather_kv(k_cache, block_tables[i], ctx).transpose(0, 1)[None]  # [1, kv_heads, ctx, dim]
        v = gather_kv(v_cache, block_tables[i], ctx).transpose(0, 1)[None]
        q = query[s:s + n].unsqueeze(0).transpose(1, 2)
        if n == ctx:  # a whole prompt in one chunk: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # a later chunk (positions ctx - n .. ctx - 1)
            pos = torch.arange(ctx - n, ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
        s += n
    return out


_SOURCES = ["binding.cpp", "paged_attention.cu"]
_CXX_FLAGS = ["-O3"]  # torch adds the C++ standard it needs (C++20 for torch 2.13)
_NVCC_FLAGS = ["-O3", "-lineinfo"]
_ext = None


def _kernels():
    """The compiled kernels, as torch.ops.laneserve: setup.py's prebuilt library if there is one, else built on
    first use with ninja into torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) for
    the GPUs present (or TORCH_CUDA_ARCH_LIST), and reused until the sources or flags change."""
    global _ext
    if _ext is None:
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            built = glob.glob(os.path.join(here, "_C*.so"))
            if built:
                torch.ops.load_library(built[0])
            else:
                from torch.utils.cpp_extension import load
                load("laneserve_attention", [os.path.join(here, s) for s in _SOURCES], extra_cflags=_CXX_FLAGS,
                     extra_cuda_cflags=_NVCC_FLAGS, is_python_module=False)
            _ext = torch.ops.laneserve
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
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         max_context_len: int | None = None) -> torch.Tensor:
    """paged_attention on CUDA tensors, by the kernel: same arguments, same result (a new contiguous tensor).
    head_dim 64 or 128, block_size 8, 16 or 32, float32/float16/bfloat16, block_tables and context_lens int32
    on the same GPU; errors otherwise. Runs on the current stream. max_context_len: the longest context_lens
    entry or more, from the host (so no device sync); it bounds the fp32 scratch. None: all that block_tables
    addresses. Each sequence's result depends on its own context alone."""
    if max_context_len is None:  # 0 for shapes the binding rejects, so that its message is the one raised
        shaped = block_tables.dim() == 2 and k_cache.dim() == 4
        max_context_len = block_tables.shape[1] * k_cache.shape[1] if shaped else 0
    with torch.cuda.device(query.device if query.is_cuda else -1):
        return _kernels().paged_attention(query, k_cache, v_cache, block_tables, context_lens, float(scale),
                                          int(max_context_len), torch.cuda.current_stream().cuda_stream)


def cuda_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv on CUDA tensors, by the kernel (slot_mapping int64, -1 skipped). Current stream."""
    with torch.cuda.device(key.device if key.is_cuda else -1):
        _kernels().store_kv(key, value, k_cache, v_cache, slot_mapping, torch.cuda.current_stream().cuda_stream)


def cuda_extension():
    """For setup.py: the kernels as a CUDAExtension `attention_cuda._C` (paths relative to the
    repository root), which _kernels() then loads instead of building; None without nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension
    if CUDA_HOME is None:
        return None
    return CUDAExtension("attention_cuda._C", [os.path.join("attention_cuda", s) for s in _SOURCES],
                         extra_compile_args={"cxx": _CXX_FLAGS, "nvcc": _NVCC_FLAGS})
