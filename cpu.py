"""CPU fast paths, an appendix to model.py and attention_cuda: the same arithmetic as the textbook forms
there, arranged to run faster on a CPU (and, with --quantization int4, the checkpoint's own 4-bit
weights). optimize() swaps them into a loaded model once; the README has the measurements."""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

import attention_cuda
from model import BatchMeta, Transformer

INT4_GROUP = 32  # inputs sharing one scale and zero, as in GGUF's Q4_0/Q4_1 blocks


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def has_bf16_units() -> bool:
    """AMX or AVX512-BF16: there bfloat16 matmuls run natively (elsewhere they are emulated, slower than float32)."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


ROW_TILE = 64   # rows per matmul call: see TiledLinear
KEY_TILE = 32   # keys per attention tile: see TiledAttention


def optimize(model: Transformer, quantization: str | None) -> None:
    """Swap the fast CPU forms into model, in place."""
    keep_freed_memory()
    model.attention, model.store_kv = TiledAttention(), store_finite_kv
    _replace(model, nn.RMSNorm, FusedRMSNorm)
    dtype, flags = model.embed.weight.dtype, _cpu_flags()
    # oneDNN packs float32 weights everywhere, bfloat16 only where these instructions exist.
    packs = torch.backends.mkldnn.is_available() and (dtype == torch.float32 or dtype == torch.bfloat16 and (
        {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags))

    def tiled(linear: nn.Linear) -> TiledLinear:
        # int4 for the layers only: GGUF files keep the LM head at 8 bits, so do we.
        if quantization == "int4" and linear is not model.lm_head:
            return TiledLinear(Int4Linear(linear.weight))
        return TiledLinear(PackedLinear(linear.weight) if packs else linear)
    _replace(model, nn.Linear, tiled)


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the next step instead of returning it to the OS. By
    default a large freed tensor is unmapped (or trimmed off the heap), and the next step's tensor of the
    same size faults every page back in, each zeroed by the kernel: a 64-lane decode step took 2-3x as
    long. Fixing the mmap threshold (32 MiB, glibc's largest) serves smaller tensors from the heap, and
    the trim threshold keeps the heap's free top. Elsewhere than glibc, nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 2**31 - 1)


def _replace(root: nn.Module, kind: type, make) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


class FusedRMSNorm(nn.Module):
    """RMSNorm as the LayerNorm of [x, -x]: its mean is 0 and its variance mean(x^2), so its first half
    is x / sqrt(mean(x^2) + eps). LayerNorm is one fused kernel on CPU where F.rms_norm is eight ops;
    like it, it computes each row alone."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), None, None, self.eps)[..., :d] * self.weight


class TiledLinear(nn.Module):
    """A linear layer run ROW_TILE rows at a time, the last tile padded with zero rows, so that the matmul
    library sees one shape whatever the batch. Matmul libraries pick their kernel by shape (a lone row
    takes a matrix-vector path; oneDNN's bfloat16 changes kernel with the row count), and kernels sum a
    row's products in different orders: without tiles a row's bits would follow its batch. With one
    shape there is one kernel, and a blocked matmul computes every row of it the same way."""

    def __init__(self, matmul: nn.Module):
        super().__init__()
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n % ROW_TILE:
            x = F.pad(x, (0, 0, 0, -n % ROW_TILE))
        return (self.matmul(x) if n <= ROW_TILE else torch.cat([self.matmul(t) for t in x.split(ROW_TILE)]))[:n]


class PackedLinear(nn.Module):
    """A weight reordered once into oneDNN's blocked layout for ROW_TILE-row inputs, instead of on every
    call. A tied LM head gets its own packed copy; the embedding stays a plain table."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, ROW_TILE), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, k] weight in 4 bits, w = (q - 8) * scale + zero with one scale and zero per INT4_GROUP inputs:
    the codes packed as torch's 4-bit CPU matmul takes them ([n, k / 2] uint8) and the scales and zeros
    ([k / INT4_GROUP, n, 2] in w's dtype). Round-to-nearest, asymmetric, as GGUF's Q4_1: each group's
    min and max become q = 0 and 15.
    On weights dequantized from a Q4_1 checkpoint that gives back its own codes, scales and mins
    (up to rounding the scales to the activations' dtype)."""
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 quantization needs matmul input sizes divisible by {INT4_GROUP}, got {k}")
    g = w.float().view(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10)  # clamped: a constant group must not divide by 0
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32).view(n, k)
    scales_zeros = torch.stack((scale, lo + 8 * scale), -1).transpose(0, 1).contiguous().to(w.dtype)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros


class Int4Linear(nn.Module):
    """--quantization int4: a quarter of bfloat16's weight traffic. One kernel serves every batch size,
    so a sequence's result still never depends on its batch."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.packed, self.scales_zeros = quantize_int4(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_zeros)


class TiledAttention:
    """Paged attention for every query token of a step, prefill or decode, computed one way: scores and
    softmax in float32, the weighted values in the cache's dtype (see weighted()).
    A token's keys 0..position are cut into tiles of KEY_TILE keys from key 0. Each matmul is one token's
    queries against one tile (scores, then the weighted values), batched over tokens and tiles; softmax
    takes the max over all of the token's scores, and the per-tile sums of weights and of weighted values
    are added in a pairwise tree in tile order. So a token's result depends on its sequence and position
    alone: not on its batch, on where its prompt was cut, or on whether it ran as a prefill or a decode.
    The one-token sequences run together, all their (sequence, tile) pairs in one batch; each longer
    prefill piece runs tile by tile, its tokens sharing each tile. What depends only on the block tables
    is planned by the first layer's call of a step and reused by the others."""

    def __init__(self):
        self.meta: BatchMeta | None = None  # what the plan below was made for

    def plan(self, meta: BatchMeta, block_size: int) -> None:
        lens, ctx = meta.query_lens, meta.host_context_lens
        ones = next((i for i, n in enumerate(lens) if n > 1), len(lens))
        per_tile = max(1, KEY_TILE // block_size)
        self.tile = tile = per_tile * block_size
        tables, key = meta.block_tables.cpu().long(), torch.arange(tile)
        self.meta, self.decodes, self.prefills = meta, None, []
        if ones:  # every (sequence, tile) pair that holds keys, sequence after sequence, tiles in order
            pos = torch.tensor(ctx[:ones]) - 1
            exists = torch.arange(int(pos.max()) // tile + 1) < (pos // tile + 1)[:, None]  # [seqs, tiles]
            width = exists.shape[1] * per_tile
            blocks = F.pad(tables[:ones], (0, width))[:, :width].reshape(ones, -1, per_tile)[exists]
            seq, j = exists.nonzero().unbind(1)
            hidden = (j[:, None] * tile + key > pos[seq, None])[:, None]
            self.decodes = (blocks.flatten(), seq, exists.flatten().nonzero()[:, 0], exists.shape, hidden)
        start = ones
        for i in range(ones, len(lens)):  # a prefill piece: its blocks, and per tile the keys each row sees
            n, tiles = lens[i], -(-ctx[i] // tile)
            blocks = F.pad(tables[i], (0, tiles * per_tile))[:tiles * per_tile]
            pos = torch.arange(ctx[i] - n, ctx[i])[:, None]
            hidden = [(j * tile + key > pos)[:, None] for j in range(tiles)]
            self.prefills.append((slice(start, start + n), blocks, hidden))
            start += n

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                 scale: float) -> torch.Tensor:
        if meta is not self.meta:
            self.plan(meta, k_cache.shape[1])
        kv_heads, dim, t = *k_cache.shape[2:], self.tile
        q = (query.float() * scale).view(query.shape[0], kv_heads, -1, dim)
        out = q.new_empty(kv_heads, q.shape[0], *q.shape[2:])  # [kv_heads, tokens, group, dim]
        if self.decodes:
            blocks, seq, slot, grid, hidden = self.decodes
            k, v = (gather_blocks(c, blocks).view(len(seq), t, kv_heads, dim) for c in (k_cache, v_cache))
            s = scores(q[seq], k.float(), hidden)  # [kv_heads, pairs, group, tile]

            def spread(x: torch.Tensor, fill: float) -> torch.Tensor:  # pairs -> [.., seqs, tiles, ..], absent: fill
                full = x.new_full((x.shape[0], grid[0] * grid[1], *x.shape[2:]), fill)
                return full.index_copy_(1, slot, x).unflatten(1, grid)
            p = s.sub_(spread(s.amax(-1, keepdim=True), float("-inf")).amax(2)[:, seq]).exp_()
            acc = pairwise(spread(weighted(p, v), 0.0), 2)
            out[:, :grid[0]] = acc[..., :-1] / acc[..., -1:]
        for rows, blocks, hidden in self.prefills:
            k, v = (gather_blocks(c, blocks).view(len(hidden), t, kv_heads, dim) for c in (k_cache, v_cache))
            n = rows.stop - rows.start
            # Every row reads the same tile: a stride-0 batch, not copies.
            s = torch.stack([scores(q[rows], kj.float().expand(n, -1, -1, -1), h) for kj, h in zip(k, hidden)])
            p = s.sub_(s.amax((0, -1), keepdim=True)).exp_()  # [tiles, kv_heads, n, group, tile]
            acc = tree_sum(weighted(pj, vj.expand(n, -1, -1, -1)) for pj, vj in zip(p, v))
            out[:, rows] = acc[..., :-1] / acc[..., -1:]
        return out.transpose(0, 1).reshape(query.shape).to(query.dtype)

    def decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, max_context_len: int | None = None) -> torch.Tensor:
        """attention_cuda.paged_attention's signature and result."""
        lens = context_lens.tolist()
        meta = BatchMeta(torch.empty(0), block_tables, context_lens, torch.empty(0), torch.empty(0), 1,
                         max(lens), [1] * len(lens), lens)
        return self(query, k_cache, v_cache, meta, scale)


def scores(q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """q [batch, kv_heads, group, dim] (scaled) against one key tile k [batch, tile, kv_heads, dim]:
    [kv_heads, batch, group, tile], -inf where hidden ([batch, 1, tile]: keys past the token's position).
    One matmul per KV head: its group of query heads against its keys."""
    s = q.new_empty(k.shape[2], q.shape[0], q.shape[2], k.shape[1])
    for h in range(k.shape[2]):
        torch.bmm(q[:, h], k[:, :, h].transpose(1, 2), out=s[h])
    return s.masked_fill_(hidden, float("-inf"))


def weighted(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weights p [kv_heads, batch, group, tile] (float32) times one value tile v [batch, tile, kv_heads, dim]
    in v's dtype, in float32 with the weights' sum appended ([kv_heads, batch, group, dim + 1]: one tree of
    sums adds both). In bfloat16 the weights are rounded to it first, as HF's eager attention rounds them,
    and the matmul sums in float32 but rounds its result (README: why)."""
    o = p.new_empty(*p.shape[:3], v.shape[3] + 1)
    o[..., -1:] = p.sum(-1, keepdim=True)
    p = p.to(v.dtype)
    for h in range(v.shape[2]):
        o[h, ..., :-1] = torch.bmm(p[h], v[:, :, h])
    return o


def pairwise(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x summed over dim level by level, (x0 + x1) + (x2 + x3), ..., a level of odd length padded with a
    zero (which gives the same bits as padding to a power of two at the start: adding 0 is exact)."""
    x = x.movedim(dim, 0)
    while x.shape[0] > 1:
        if x.shape[0] % 2:
            x = torch.cat((x, x.new_zeros(1, *x.shape[1:])))
        x = x[0::2] + x[1::2]
    return x[0]


def tree_sum(leaves) -> torch.Tensor:
    """The leaves summed as pairwise() sums them, one leaf at a time: two partial sums over equally many
    leaves are added as soon as both exist, and what is left at the end is added from the right."""
    stack: list[tuple[int, torch.Tensor]] = []
    for x in leaves:
        size = 1
        while stack and stack[-1][0] == size:
            x, size = stack.pop()[1] + x, size * 2
        stack.append((size, x))
    x = stack.pop()[1]
    while stack:
        x = stack.pop()[1] + x
    return x


def store_finite_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """attention_cuda.store_kv, values that are not finite stored as 0. TiledAttention weighs the slots
    of a tile past a sequence's end (left by a block's former owner) by exactly 0, which is only 0 for
    a finite value: a sequence that went NaN must not reach the next owner of its blocks."""
    attention_cuda.store_kv(key, value.nan_to_num(0.0, 0.0, 0.0), k_cache, v_cache, slot_mapping)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks `blocks` (int64 ids), one row each. A block is one contiguous row of the cache,
    so the gather is a row index_select: a memcpy per block."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)
