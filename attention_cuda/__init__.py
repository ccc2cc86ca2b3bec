"""Paged attention: the pure-PyTorch reference (the test oracle; prefill on every device). Our CUDA kernel for
decode is paged_attention.cu, built and launched by kernel.py; cpu.py holds a faster CPU form of both, tested
against the reference."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

# The 8-bit KV cache types (--kv-cache-dtype) and their largest code: a stored token-head vector's largest |value|
# becomes QMAX, so that its scale, amax / QMAX, is one float32 per token and KV head (the lanes rule: a token's
# stored bytes depend on its own values alone).
QMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, kv_heads, head_dim] as codes of dtype (one of QMAX's) and float32 scales [n, kv_heads], in float32:
    code = x * (QMAX / amax), rounded to nearest even (int8: clamped to +-127); scale = amax / QMAX. The CUDA
    kernel computes the same, bit for bit. Tensors on both sides of each division: torch multiplies by a
    reciprocal instead for number / tensor, and on CUDA for tensor / number."""
    x = x.float()
    amax = x.abs().amax(-1)
    qmax = torch.full_like(amax, QMAX[dtype])
    inv = qmax / amax
    inv = torch.where(inv.isfinite(), inv, 0.0)  # amax 0, NaN or below ~1e-36 (QMAX / amax overflows): codes 0
    y = x * inv[..., None]
    codes = y.round().clamp_(-127, 127).to(dtype) if dtype == torch.int8 else y.to(dtype)
    return codes, amax / qmax


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_kv's inverse, up to its rounding: code * scale in float32, then cast to dtype."""
    return (codes.float() * scales[..., None]).to(dtype)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each new token's K/V ([num_tokens, kv_heads, dim]) into the paged cache ([num_blocks, block_size,
    kv_heads, dim]) at its slot = block_id * block_size + offset; slot -1 (padding) is skipped. With scales
    ([num_blocks, block_size, kv_heads] float32: an 8-bit cache), quantized (quantize_kv); else rounded to the cache's
    dtype."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for x, cache, scales in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if scales is not None:
            x, s = quantize_kv(x, cache.dtype)
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, s)
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)  # torch has no float8 index_copy_
        # Viewing the cache as [num_slots, heads, dim] turns the slot into a plain row index.
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def gather_kv(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One sequence's first num_tokens cached tokens, in order: [num_tokens, kv_heads, dim]; with scales (an 8-bit
    cache), dequantized to dtype. Token t lives in block block_table[t // block_size], row t % block_size."""
    t = torch.arange(num_tokens, device=cache.device)
    index = block_table.to(cache.device)[t // cache.shape[1]].long(), t % cache.shape[1]
    return cache[index] if scales is None else dequantize_kv(cache[index], scales[index], dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decode attention, one query token per sequence: query [num_seqs, num_heads, head_dim] attends to its sequence's
    first context_lens[i] cached tokens (its own included; window > 0: the last `window` of them) alone; query head h
    reads KV head h // (num_heads / num_kv_heads) (grouped-query attention). In float32 (float64 stays float64),
    sequence by sequence; returns query's shape and dtype (zeros for context 0). max_context_len: for the kernel's
    signature. k_scale, v_scale: an 8-bit cache's (see store_kv)."""
    group = query.shape[1] // k_cache.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    out = torch.empty_like(query)
    for i, n in enumerate(context_lens.tolist()):
        k, v = (
            gather_kv(c, block_tables[i], n, s, acc)[max(0, n - window) if window else 0 :]
            .to(acc)
            .repeat_interleave(group, dim=1)
            for c, s in ((k_cache, k_scale), (v_cache, v_scale))
        )
        scores = torch.einsum("hd,nhd->hn", query[i].to(acc), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out


def paged_attention_varlen(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: list[int],
    host_context_lens: list[int],
    scale: float,
    decode: Callable = paged_attention,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention (window > 0: over the last `window` positions) for a flattened batch of sequences. Sequence i
    owns the next query_lens[i] rows of query ([total_tokens, num_heads, head_dim]), the last of its context_lens[i]
    tokens: row j sits at position context_len - q_len + j and sees keys 0..that position of its sequence alone. The
    leading one-token sequences go to `decode` together (the CUDA kernel on GPU), the rest to SDPA. query_lens,
    host_context_lens: host lists. k_scale, v_scale: an 8-bit cache's, its keys and values dequantized to query's dtype
    for SDPA."""
    ones = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
    out = torch.empty_like(query)
    if ones:
        out[:ones] = decode(
            query[:ones],
            k_cache,
            v_cache,
            block_tables[:ones],
            context_lens[:ones],
            scale,
            max(host_context_lens[:ones]),
            k_scale,
            v_scale,
            window,
        )
    s = ones
    for i in range(ones, len(query_lens)):
        n, ctx = query_lens[i], host_context_lens[i]
        k, v = (
            gather_kv(c, block_tables[i], ctx, sc, query.dtype).transpose(0, 1)[None]  # [1, kv_heads, ctx, dim]
            for c, sc in ((k_cache, k_scale), (v_cache, v_scale))
        )
        q = query[s : s + n].unsqueeze(0).transpose(1, 2)
        if n == ctx and not window:  # a whole prompt in one chunk: plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # a later chunk (positions ctx - n .. ctx - 1), or a window
            pos = torch.arange(ctx - n, ctx, device=query.device)[:, None]
            mask = (key := torch.arange(ctx, device=query.device)) <= pos
            mask &= key > pos - window if window else True
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + n] = o[0].transpose(0, 1)
        s += n
    return out
