"""CPU fast paths, an appendix to model.py and attention_cuda: the textbook forms there, arranged to run faster on
a CPU (in bfloat16 the attention rounds where HF's eager attention does; with --quantization int4, the
checkpoint's own 4-bit weights). optimize() swaps them into a loaded model once."""

from __future__ import annotations

import ctypes
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import attention_cuda
import cpu_matmul
import weights
from model import BatchMeta, Block, Transformer

INT4_GROUP = 32  # inputs sharing one scale and zero, as in GGUF's Q4_0/Q4_1 blocks
ROW_TILE = 64  # the most rows per matmul call: see row_tile
KEY_BUCKET = 64  # a token's keys rounded up to a multiple of this: see BucketedAttention
GROUP = 64  # prompt positions per attention item: see BucketedAttention (KEY_BUCKET is a multiple)
TOKEN_PROMPT = 192  # prompt positions token_attention computes, where it runs: see BucketedAttention (GROUP's multiple)
CALL_BYTES = 8 << 20  # the keys one of BucketedAttention's batched matmuls reads, at most (as many values)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(f.read().split())
    except OSError:
        return set()


def has_bf16_units() -> bool:
    """AMX or AVX512-BF16: there bfloat16 matmuls run natively (elsewhere they are emulated, slower than float32)."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def check_free_memory(nbytes: int) -> None:
    """MemoryError if nbytes is more than 90% of what Linux says it can still give without swapping (MemAvailable),
    the rest left to the steps' activations. Linux grants a larger allocation anyway and kills the process as the
    pages fill, with no message (the OOM killer)."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):  # not Linux: the allocator's own refusal is all there is
        return
    if nbytes > 0.9 * free:
        raise MemoryError(f"that is {nbytes / 2**30:.1f} GiB, more than 90% of the {free / 2**30:.1f} GiB free")


def own_format(checkpoint: str | None) -> str | None:
    """--quantization's default on this CPU: "int4" for a GGUF whose matmul weights are all Q4_1, where the kernels
    run (int4 gives back the file's own codes, as llama.cpp serves it; its 8-bit dot products beat bfloat16's at
    every batch size in every kernel variant), else None (bfloat16, or float32, as the dtype says)."""
    if cpu_matmul.isa() is None or not (checkpoint or "").endswith(".gguf"):
        return None
    kinds = {t.tensor_type.name for t in weights.read_gguf(checkpoint).tensors if t.name.startswith("blk.")}
    return "int4" if kinds - {"F32"} == {"Q4_1"} else None


def choices(dtype: torch.dtype, quantization: str | None, asked: bool = False) -> str:
    """What runs on this CPU and why, in a line (serve.py prints it at startup). asked: --dtype named the dtype."""
    isa = cpu_matmul.isa()
    kernel = next((name for name, i in cpu_matmul.ISAS.items() if i == isa), None)
    units = "has bf16 dot products" if has_bf16_units() else "has no bf16 dot products"
    name = str(dtype).removeprefix("torch.")
    weights_as = (
        f"4-bit groups (int4: a Q4_1 GGUF's own blocks) by 8-bit codes of {name} activations, as llama.cpp"
        if quantization
        else f"{name}: " + ("as --dtype asks" if asked else f"this CPU {units}")
    )
    return (
        f"CPU matmul kernels {kernel or 'off (oneDNN and row tiles)'}; weights as {weights_as}"
        + ("" if quantization else "; --quantization int4 for 4-bit weights")
        + ("; --dtype float32 for HF parity" if dtype != torch.float32 or quantization else "")
    )


def row_tile(max_num_seqs: int) -> int:
    """Rows per matmul call: max_num_seqs rounded up to a power of two, from 16 to ROW_TILE. A full decode step
    fits one tile, and a few sequences do not pay for 64 rows per token."""
    return min(ROW_TILE, max(16, 1 << (max_num_seqs - 1).bit_length()))


def optimize(model: Transformer, quantization: str | None, max_num_seqs: int) -> None:
    """Swap the fast CPU forms into model, in place."""
    keep_freed_memory()
    tile = row_tile(max_num_seqs)
    dtype, flags = model.embed.weight.dtype, _cpu_flags()
    # oneDNN packs float32 weights everywhere, bfloat16 only where these instructions exist.
    packs = torch.backends.mkldnn.is_available() and (
        dtype == torch.float32
        or dtype == torch.bfloat16
        and ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)
    )

    isa = cpu_matmul.isa() if dtype in cpu_matmul.KINDS else None  # the kernels take float32 and bfloat16
    model.attention = BucketedAttention(kernel=isa is not None and model.config.head_dim % 8 == 0)
    model.store_kv = store_finite_kv
    _replace(model, nn.RMSNorm, cpu_matmul.RMSNorm if isa else FusedRMSNorm)

    def tiled(linear: nn.Linear) -> nn.Module:
        # int4 for the layers only: GGUF files keep the LM head at 8 bits (Q8_0), so does our kernel.
        int4 = quantization == "int4" and linear is not model.lm_head
        if isa:  # our kernel computes a row alike in any batch: no tiles
            return cpu_matmul.Linear(linear.weight, isa, "int4" if int4 else "int8" if quantization else None)
        if int4:
            return TiledLinear(Int4Linear(linear.weight), tile)
        return TiledLinear(PackedLinear(linear.weight, tile) if packs else linear, tile)

    _replace(model, nn.Linear, tiled)
    c = model.config  # Llama's layers, whole (one rank's shards add their outputs across ranks: no residual there)
    if isa and not (c.qk_norm or c.gemma) and all(layer.heads == c.num_attention_heads for layer in model.layers):
        for layer in model.layers:
            layer.forward = FusedBlock(layer)


class FusedBlock:
    """Block.forward's bits for a Llama layer on cpu_matmul, in fewer ops and with its modules looked up once (at one
    stream a step is mostly per-op Python and dispatch beside the weights: benchmarks/README.md, "A layer in two ops"):
    RoPE and the K/V store are one op (rows.cpp's rope_store), the residual add rides on the o matmul, and the MLP
    with its norm and residual is one op (layer.cpp's mlp); in a step whose tokens all take token_attention (a
    decode step, a short prompt's prefill) so is the attention half (layer.cpp's attend). An 8-bit cache takes
    Block.forward."""

    def __init__(self, block: Block):
        self.block, self.heads, self.scale, self.window = block, block.heads, block.scale, block.window
        self.attn_norm, self.qkv, self.o = block.attn_norm.forward, block.qkv.forward, block.o.forward
        self.rope_store = torch.ops.laneserve_cpu.rope_store.default
        # layer.cpp's ops with the layer's arguments bound, positionally (keywords are parsed by name every call)
        qkv, o, norm = block.qkv, block.o, block.attn_norm
        self.attend = partial(
            torch.ops.laneserve_cpu.attend.default,
            norm.weight,
            norm.eps,
            qkv.packed,
            qkv.kind,
            qkv.n,
            block.heads,
            block.scale,
            block.window,
            o.packed,
            o.kind,
            o.n,
            qkv.isa,
        )
        up, down, norm = block.gate_up, block.down, block.mlp_norm
        self.mlp = partial(
            torch.ops.laneserve_cpu.mlp.default,
            norm.weight,
            norm.eps,
            up.packed,
            up.kind,
            up.n,
            down.packed,
            down.kind,
            down.n,
            up.isa,
        )

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMeta,
        kv_cache: tuple[torch.Tensor, ...],
        ops: Transformer,
    ) -> torch.Tensor:
        if len(kv_cache) > 2:
            return Block.forward(self.block, x, cos, sin, meta, kv_cache, ops)
        attention = ops.attention
        token_calls, group_calls = (
            attention.planned(meta, kv_cache[0], x.dtype, self.window)
            if isinstance(attention, BucketedAttention) and attention.kernel
            else ([], [])
        )
        if token_calls and not group_calls:  # every token generated: one op
            tables, rows, seqs, positions = token_calls[0]
            return self.mlp(self.attend(x, cos, sin, *kv_cache, meta.slot_mapping, tables, rows, seqs, positions))
        n = x.shape[0]
        q = self.rope_store(self.qkv(self.attn_norm(x)), cos, sin, *kv_cache, meta.slot_mapping, self.heads)
        return self.mlp(self.o(ops.attention(q, *kv_cache, meta, self.scale, window=self.window).view(n, -1), x))


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the next step: by default a large freed tensor is unmapped (or trimmed
    off the heap), and the next step's tensor of the same size faults every page back in, each zeroed by the kernel.
    A fixed mmap threshold (32 MiB, glibc's largest) serves smaller tensors from the heap, and the trim threshold keeps
    the heap's free top; the process stays at its peak size. A thread other than the main one (the server's engine
    thread) allocates from heaps of at most 64 MiB, which glibc unmaps once empty whatever the trim threshold: in a
    fragmented one every tensor that fits no hole would map a new heap. The top pad keeps 64 MiB beyond the top."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # from glibc's malloc.h
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 2**31 - 1)
    mallopt(m_top_pad, 64 << 20)


def _replace(root: nn.Module, kind: type, make) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


class FusedRMSNorm(nn.Module):
    """RMSNorm as the LayerNorm of [x, -x] (mean 0, variance mean(x^2)): its first half is x / sqrt(mean(x^2) + eps).
    LayerNorm is one fused kernel on CPU where F.rms_norm is eight ops; like it, it computes each row alone."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight.detach(), norm.eps  # a plain tensor, no hooks: as cpu_matmul.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), None, None, self.eps)[..., :d] * self.weight

    __call__ = forward


class TiledLinear(nn.Module):
    """Where cpu_matmul's kernel is not used (it did not build, no ISA fits, or LANESERVE_CPU_MATMUL=off):
    a linear layer run `tile` rows at a time, the last tile padded with zero rows: the matmul library sees
    one shape whatever the batch. Libraries pick their kernel by shape (a lone row takes a matrix-vector path;
    oneDNN's bfloat16 changes kernel with the row count), and kernels sum in different orders, so without tiles
    a row's bits would follow its batch. One shape, one kernel: a blocked matmul computes every row the same way."""

    def __init__(self, matmul: nn.Module, tile: int):
        super().__init__()
        self.matmul, self.tile = matmul, tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tile = x.shape[0], self.tile
        if n % tile:
            x = F.pad(x, (0, 0, 0, -n % tile))
        return (self.matmul(x) if n <= tile else torch.cat([self.matmul(t) for t in x.split(tile)]))[:n]


class PackedLinear(nn.Module):
    """A weight reordered once into oneDNN's blocked layout for `rows`-row inputs, instead of on every
    call. A tied LM head gets its own packed copy; the embedding stays a plain table."""

    def __init__(self, weight: torch.Tensor, rows: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, rows), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, k] weight in 4 bits, w = (q - 8) * scale + zero, one scale and zero per INT4_GROUP inputs: codes packed
    for torch's 4-bit CPU matmul ([n, k / 2] uint8), scales and zeros as [k / INT4_GROUP, n, 2] in w's dtype.
    The codes of cpu_matmul.int4_groups (GGUF's Q4_1), the scales rounded to the activations' dtype."""
    q, scale, lo = cpu_matmul.int4_groups(w, INT4_GROUP)
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


class BucketedAttention:
    """Paged attention for every query token of a step, prefill or decode, each token computed one way, fixed by its
    position and kind (prompt or generated), so that its result never depends on its batch, on where its prompt was
    cut or on what else its group holds (ARCHITECTURE.md, "Lanes never mix"). A token at position p reads its
    sequence's first b keys, b = p + 1 rounded up (key_bucket), those past p masked:
    - A generated token is its own item: scores ([heads, kv_heads * dim] by [kv_heads * dim, b]) and weighted values
      ([heads, b] by [b, kv_heads * dim]), with its own copy of the keys. Items with the same b run together.
      Where cpu_matmul builds (kernel), its token_attention computes every generated token instead, and the prompt
      tokens at positions below TOKEN_PROMPT (where it is the faster: a short prompt's whole prefill is then the
      one-op layers of FusedBlock), one task per run of a sequence's tokens (or per KV head or query head and part
      of the run, in a step of few runs), each token reading only keys 0..p.
    - Other prompt tokens come GROUP positions to an item, [GROUP * g, GROUP * (g + 1)) of one sequence, each KV
      head its own: ([GROUP * heads / kv_heads, dim] by [dim, b]), then ([..., b] by [b, dim]); positions the step
      does not bring are rows of zeros. Key buckets are multiples of GROUP, so a group shares one b and one copy of
      its keys.
    The softmax runs between the matmuls in the query's dtype, where HF's eager attention rounds. An 8-bit cache's
    keys and values are dequantized to it as they are copied, each token's from its own codes and scale alone. No
    batch has one item (float32's batched matmul takes another kernel for one): a lone item runs twice. Copies are
    made CALL_BYTES at a time. A step's first layer plans what depends on the step's BatchMeta alone; the others
    reuse it. A sliding window (Gemma 3's local layers) masks the keys before it too: still a function of the
    token's position alone; those layers get a plan of their own."""

    def __init__(self, kernel: bool | None = None):
        self.kernel = cpu_matmul.isa() is not None if kernel is None else kernel
        self.meta: BatchMeta | None = None  # what the plans below were made for
        self.plans: dict[int, tuple[list, list]] = {}  # by window

    def plan(self, meta: BatchMeta, k_cache: torch.Tensor, dtype: torch.dtype, window: int = 0) -> tuple[list, list]:
        """dtype: the query's, which the keys and values are computed in. Returns the token and group calls."""
        ctx, decodes = meta.host_context_lens, meta.max_query_len == 1
        if self.kernel and decodes and all(c > p for c, p in zip(ctx, meta.prompt_lens)):  # every row generated
            rows = torch.arange(len(ctx))  # the general plan's, for this case, in fewer ops
            return [(meta.block_tables.cpu().long(), rows, rows, torch.tensor(ctx) - 1)], []
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        key_bytes = kv_heads * k_cache.shape[3] * dtype.itemsize
        lens, ctx = torch.tensor(meta.query_lens), torch.tensor(meta.host_context_lens)
        seq = torch.arange(len(lens)).repeat_interleave(lens)  # each query row's sequence
        # a row's position: its sequence's context length, less its piece's length, plus its index in the piece
        pos = ctx[seq] - lens.cumsum(0)[seq] + torch.arange(len(seq))
        smallest = max(KEY_BUCKET, block_size)
        prompt = pos < torch.tensor(meta.prompt_lens, dtype=torch.long)[seq]
        tables = meta.block_tables.cpu().long()
        self.spread = torch.eye(kv_heads, dtype=dtype).view(1, kv_heads, 1, kv_heads, 1)  # see __call__
        token_calls, group_calls = [], []

        def score_mask(p: torch.Tensor, b: int) -> torch.Tensor:  # added to the scores: -inf for keys after p
            key = torch.arange(b)  # (or before its window), else 0
            hidden = (key > p) | (key <= p - window) if window else key > p
            return torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))

        def blocks(seqs: torch.Tensor, b: int) -> torch.Tensor:  # their first b keys' blocks, block 0 past the end
            return F.pad(tables[seqs], (0, b // block_size))[:, : b // block_size]

        def calls(buckets: torch.Tensor, least: int):
            """Per call: b, every index whose bucket is b, and the call's indices (CALL_BYTES of keys, or least)."""
            for b in buckets.unique().tolist():
                members = (buckets == b).nonzero()[:, 0]
                per = max(least, CALL_BYTES // (b * key_bytes))
                for i in range(0, len(members), per):
                    yield b, members, members[i : i + per]

        generated = (~prompt).nonzero()[:, 0]
        if self.kernel:  # token_attention: the generated tokens, and the prompt's first TOKEN_PROMPT positions
            prompt &= pos >= TOKEN_PROMPT
            tokens = (~prompt).nonzero()[:, 0]
            token_calls = [(tables, tokens, seq[tokens], pos[tokens])] if len(tokens) else []
            generated = generated[:0]
        for b, rows, r in calls(key_bucket(pos + 1, smallest)[generated], 2):
            if len(r) == 1:  # run a lone row with the one before it, or twice
                r = rows[-2:] if len(rows) > 1 else rows.repeat(2)
            r = generated[r]
            token_calls.append((r, blocks(seq[r], b), score_mask(pos[r, None], b)[:, None]))
        rows = prompt.nonzero()[:, 0]
        if not len(rows):  # a step of decodes
            return token_calls, []
        # Group ids: sequence * span + position // GROUP, sorted. A group's GROUP query rows hold the row
        # at that position, or len(seq): the row of zeros __call__ appends.
        span = int(ctx.max()) // GROUP + 1
        ids, group = (seq[rows] * span + pos[rows] // GROUP).unique(return_inverse=True)
        query_rows = torch.full((len(ids), GROUP), len(seq))
        query_rows[group, pos[rows] % GROUP] = rows
        first = ids % span * GROUP  # each group's first position
        # key_bucket(first + GROUP) is the bucket of every position in the group
        for b, _, g in calls(key_bucket(first + GROUP, smallest), 1):
            run = g.repeat(2) if len(g) * kv_heads == 1 else g
            mask = score_mask((first[run, None] + torch.arange(GROUP))[..., None], b)
            index = query_rows[g].flatten()
            present = (index < len(seq)).nonzero()[:, 0]
            group_calls.append((query_rows[run].flatten(), blocks(ids[run] // span, b), mask, index[present], present))
        return token_calls, group_calls

    def planned(self, meta: BatchMeta, k_cache: torch.Tensor, dtype: torch.dtype, window: int) -> tuple[list, list]:
        """plan's calls, made once per step and window."""
        if meta is not self.meta:
            self.meta, self.plans = meta, {}
        if window not in self.plans:
            self.plans[window] = self.plan(meta, k_cache, dtype, window)
        return self.plans[window]

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMeta,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        token_calls, group_calls = self.planned(meta, k_cache, query.dtype, window)
        n, heads, dim = query.shape
        kv_heads = k_cache.shape[2]
        heads_per_kv = heads // kv_heads
        out = torch.empty(n, kv_heads, heads_per_kv, dim, dtype=query.dtype)

        def keys_values(blocks: torch.Tensor) -> list[torch.Tensor]:
            return [gather_keys(c, blocks, s, query.dtype) for c, s in ((k_cache, k_scale), (v_cache, v_scale))]

        if token_calls and self.kernel:
            torch.ops.laneserve_cpu.token_attention(
                query.contiguous(),
                k_cache,
                v_cache,
                *token_calls[0],
                scale,
                window,
                k_scale,
                v_scale,
                out.view(n, heads, dim),
            )
        elif token_calls:
            # Grouped-query attention without a copy of the keys per query head: query head h is laid out
            # across all kv_heads * dim columns, zero outside its own KV head's slice (a product with the
            # identity, exact), so one matmul with the keys as gathered gives every head its scores.
            q = (query.view(n, kv_heads, -1, 1, dim) * scale * self.spread).view(n, heads, kv_heads * dim)
            for rows, blocks, mask in token_calls:
                k, v = keys_values(blocks)
                s = torch.bmm(q.index_select(0, rows), k.transpose(1, 2)).add_(mask)
                o = torch.bmm(s.softmax(-1), v).view(len(rows), kv_heads, -1, kv_heads, dim)
                # Backwards: head h's result is the slice of its row that belongs to its KV head.
                out.index_copy_(0, rows, o.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2))
        if group_calls:

            def by_kv_head(x: torch.Tensor, items: int, length: int) -> torch.Tensor:
                """[items * length, kv_heads * width] as [items * kv_heads, length * width / dim, dim]."""
                return x.view(items, length, kv_heads, -1).transpose(1, 2).reshape(items * kv_heads, -1, dim)

            q = torch.cat((query * scale, query.new_zeros(1, heads, dim)))
            for index, blocks, mask, rows, present in group_calls:
                items, b = mask.shape[0], mask.shape[-1]
                k, v = (by_kv_head(x, items, b) for x in keys_values(blocks))
                s = torch.bmm(by_kv_head(q.index_select(0, index), items, GROUP), k.transpose(1, 2))
                s.view(items, kv_heads, GROUP, heads_per_kv, b).add_(mask[:, None, :, None])
                o = torch.bmm(s.softmax(-1), v).view(items, kv_heads, GROUP, heads_per_kv, dim).transpose(1, 2)
                o = o.reshape(items * GROUP, kv_heads, heads_per_kv, dim)
                out.index_copy_(0, rows, o.index_select(0, present))
        return out.view(n, heads, dim)

    def decode(
        self,
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
        """attention_cuda.paged_attention's signature and result."""
        lens = context_lens.tolist()
        meta = BatchMeta(
            torch.empty(0),
            block_tables,
            context_lens,
            torch.empty(0),
            1,
            max(lens),
            [1] * len(lens),
            lens,
            [0] * len(lens),
        )
        return self(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window)


def key_bucket(n: torch.Tensor, smallest: int) -> torch.Tensor:
    """How many keys tokens that see n keys read: n rounded up to a multiple of the largest power of two
    at most n / 8, or of smallest (a power of two) if that is larger. Past 8 * smallest keys at most an
    eighth of the keys read are masked, and long contexts fall into few buckets."""
    e = torch.frexp(n.double())[1]  # 2 ** (e - 1) <= n < 2 ** e
    step = (1 << (e - 4).clamp_min(0)).clamp_min(smallest)
    return (n + step - 1) // step * step


def gather_keys(
    cache: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The slots of blocks ([rows, n] block ids) as [rows, n * block_size, kv_heads * dim], contiguous. A
    block is one contiguous row of the cache, so the gather is a row index_select: a memcpy per block. With
    scales (an 8-bit cache), the same blocks' scales too, and the codes dequantized to dtype; without, the values
    in dtype (a bfloat16 cache's beside float32 queries: exact)."""
    x = cache.view(cache.shape[0], -1).index_select(0, blocks.flatten())
    if scales is not None:
        s = scales.view(scales.shape[0], -1).index_select(0, blocks.flatten())
        x = attention_cuda.dequantize_kv(x.view(-1, cache.shape[3]), s.view(-1), dtype)
    return x.view(len(blocks), -1, cache.shape[2] * cache.shape[3]).to(dtype)


def store_finite_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """attention_cuda.store_kv (quantizing into an 8-bit cache), non-finite keys and values stored as 0.
    BucketedAttention reads slots past a sequence's end (another sequence's, or a block's former owner's) and weighs
    them by exactly 0 (an added -inf score), which needs finite keys and values. The weights bound the finite keys
    (an RMSNorm, then a projection); a sequence that went NaN or inf must not reach the next owner of its blocks."""
    finite = (x.nan_to_num(0.0, 0.0, 0.0) for x in (key, value))
    attention_cuda.store_kv(*finite, k_cache, v_cache, slot_mapping, k_scale, v_scale)
