"""Tests of attention_cuda: the pure-PyTorch reference against a naive float64 loop (CPU), the CUDA
sources against the compilers (needs nvcc, no GPU), and the kernel against the reference (GPU)."""

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import attention_cuda
import attention_cuda.kernel
import cpu
import cpu_matmul
from attention_cuda import paged_attention, paged_attention_varlen, store_kv
from model import BatchMeta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
DEVICE = "cuda"  # where the kernel tests put their tensors


# helpers


def make_batch(
    seed, lanes, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, q_scale=2.0, extra_columns=2
):
    """A random paged cache and a flattened batch of lanes, each lane (context_len, q_len), on the
    CPU. Blocks are handed out in shuffled order (so no lane's blocks are contiguous or in order),
    some blocks belong to no lane, and unused block-table entries are 0, as the engine leaves them."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block_size) for ctx, _ in lanes]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lanes), max(need) + extra_columns, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q_lens = [n for _, n in lanes]
    query = (torch.randn(sum(q_lens), num_heads, head_dim, generator=g) * q_scale).to(dtype)
    context_lens = torch.tensor([ctx for ctx, _ in lanes], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return query, k_cache, v_cache, tables, context_lens, query_start_loc


def naive_attention(
    query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, rounded=None, window=0
):
    """Lane by lane, token by token through the block table, softmax written out, in float64; with
    `rounded` (a dtype), the scaled query, the scores and the weights are rounded to it on the way; with
    `window`, a token at pos sees keys pos - window + 1 .. pos only."""
    r = (lambda x: x.to(rounded).double()) if rounded else (lambda x: x)
    block_size, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(len(context_lens)):
        start, end, ctx = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(context_lens[i])
        slots = [(int(block_tables[i, t // block_size]), t % block_size) for t in range(ctx)]
        keys = torch.stack([k_cache[b, o] for b, o in slots]).double()  # [ctx, kv_heads, dim]
        values = torch.stack([v_cache[b, o] for b, o in slots]).double()
        for row in range(start, end):
            pos = ctx - (end - start) + (row - start)  # this query token's position; it sees 0..pos
            first = max(0, pos - window + 1) if window else 0
            for h in range(query.shape[1]):
                logits = r(keys[first : pos + 1, h // group] @ r(query[row, h].double() * scale))
                w = torch.exp(logits - logits.max())
                out[row, h] = r(w / w.sum()) @ values[first : pos + 1, h // group]
    return out


def varlen(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """paged_attention_varlen on a make_batch batch, with the host's copies of its lengths."""
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    return paged_attention_varlen(
        query, k_cache, v_cache, block_tables, context_lens, query_lens, context_lens.tolist(), scale
    )


def reference_decode(query, k_cache, v_cache, block_tables, context_lens, scale):
    """The reference decode on CPU in float32."""
    return paged_attention(
        query.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(), block_tables.cpu(), context_lens.cpu(), scale
    )


# the reference, on CPU


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_reference_varlen_matches_naive(group, block_size):
    # Decode lanes (leading ones go to the decode path together, later ones through SDPA), whole prompts,
    # and prefill chunks with earlier context, in mixed order; contexts ending mid-block and exactly on a
    # block boundary.
    lanes = [
        (1, 1),
        (37, 1),
        (7, 7),
        (50, 9),
        (2 * block_size, 1),
        (block_size + 1, block_size + 1),
        (70, 16),
        (block_size - 1, 1),
        (3 * block_size, block_size),
    ]
    head_dim = 128 if group == 4 else 64
    batch = make_batch(group * 10 + block_size, lanes, 2 * group, 2, head_dim, block_size)
    scale = head_dim**-0.5
    out = varlen(*batch, scale)
    expected = naive_attention(*batch, scale)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_reference_decode_matches_naive():
    lanes = [(1, 1), (16, 1), (17, 1), (100, 1), (63, 1)]  # SmolLM2-135M shapes: 9 heads over 3 KV heads
    query, k_cache, v_cache, tables, lens, starts = make_batch(7, lanes, 9, 3, 64, 16)
    out = paged_attention(query, k_cache, v_cache, tables, lens, 0.125)
    expected = naive_attention(query, k_cache, v_cache, tables, lens, starts, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window_in_every_form(window, dtype):
    # Gemma 3's local layers: the reference (decode and varlen: whole prompts, later chunks) and cpu.py's attention
    # (generated and prompt tokens) against the float64 loop, windows shorter and longer than the lanes, a window
    # start mid-block and mid-bucket.
    lanes = [(1, 1), (37, 1), (300, 1), (70, 1), (7, 7), (50, 9), (130, 130), (200, 70)]
    batch = make_batch(window, lanes, 8, 2, 64, 16, dtype)
    expected = naive_attention(
        *[x.double() if x.is_floating_point() else x for x in batch],
        0.125,
        rounded=dtype if dtype != torch.float32 else None,
        window=window,
    )
    if dtype == torch.float32:  # the reference's SDPA rounds otherwise than HF's eager attention in bfloat16
        starts = batch[5].tolist()
        out = paged_attention_varlen(
            *batch[:5], [b - a for a, b in zip(starts, starts[1:])], batch[4].tolist(), 0.125, window=window
        )
        torch.testing.assert_close(out.double(), expected, **CPU_TOLERANCE[dtype])
    prompt_lens = [c - n // 2 if i % 2 else 0 for i, (c, n) in enumerate(lanes)]  # prompt and generated tokens
    meta = BatchMeta(
        torch.empty(0),
        batch[3],
        batch[4],
        torch.empty(0),
        130,
        300,
        [n for _, n in lanes],
        [c for c, _ in lanes],
        prompt_lens,
    )
    out = cpu.BucketedAttention()(*batch[:3], meta, 0.125, window=window)
    torch.testing.assert_close(out.double(), expected, **CPU_TOLERANCE[dtype])
    if window < 300:  # the window matters: without it, the longest lane's answer differs
        assert (paged_attention(*batch[:5], 0.125)[2] - out[2]).abs().max() > 1e-2


# In bfloat16 the scores and the weights are rounded to it, as HF's eager attention rounds them: the
# float64 loop rounds them too (with scores up to about 10 here, unrounded ones differ by up to 0.02).
CPU_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-3, rtol=1.2e-2)}


def cpu_attention(query, k_cache, v_cache, block_tables, lanes, scale, prompt_lens=None, scales=(), kernel=None):
    """cpu.BucketedAttention on a step of lanes [(context_len, q_len)], one-token lanes first as the runner
    orders them; prompt_lens: each lane's (by default, every token a generated one); scales: an 8-bit cache's;
    kernel: whether generated tokens take cpu_matmul's token_attention (None: where it builds)."""
    lens = [n for _, n in lanes]
    ctx = [c for c, _ in lanes]
    meta = BatchMeta(
        torch.empty(0),
        block_tables,
        torch.tensor(ctx, dtype=torch.int32),
        torch.empty(0),
        max(lens),
        max(ctx),
        lens,
        ctx,
        prompt_lens or [0] * len(lanes),
    )
    return cpu.BucketedAttention(kernel)(query, k_cache, v_cache, meta, scale, *scales)


KERNEL = pytest.mark.parametrize(
    "kernel",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(cpu_matmul.isa() is None, reason="cpu_matmul's kernels need AVX2 and a compiler"),
        ),
        False,
    ],
    ids=["kernel", "torch"],
)
KV8 = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]  # --kv-cache-dtype int8, fp8_e4m3, fp8_e5m2


def quantized(cache, dtype):
    """A make_batch cache stored in 8 bits: its codes ([num_blocks, block_size, kv_heads, dim]), its scales
    ([num_blocks, block_size, kv_heads]) and what they dequantize to in float32."""
    codes, scales = attention_cuda.quantize_kv(cache.flatten(0, 1), dtype)
    codes, scales = codes.view(cache.shape), scales.view(cache.shape[:3])
    return codes, scales, attention_cuda.dequantize_kv(codes, scales, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads, head_dim, block_size", [((9, 3), 64, 16), ((4, 4), 128, 8), ((8, 1), 64, 32)])
@pytest.mark.parametrize("kind", ["generated", "prompt", "both"])
@KERNEL
def test_cpu_attention_matches_naive(heads, head_dim, block_size, dtype, kind, kernel):
    # cpu.py's attention (keys in buckets) against the float64 loop: decodes and prefill pieces with
    # earlier context, contexts within one bucket and across several, past 1,024 keys (wider buckets);
    # generated tokens, prompt tokens (in groups), and both in one step and in one piece.
    lanes = [
        (1, 1),
        (block_size - 1, 1),
        (block_size, 1),
        (block_size + 1, 1),
        (300, 1),
        (37, 1),
        (1100, 1),
        (7, 7),
        (50, 9),
        (2 * cpu.KEY_BUCKET + 5, 40),
        (block_size + 1, block_size + 1),
        (1030, 8),
        (200, 150),
    ]
    prompt_lens = {
        "generated": None,
        "prompt": [c for c, _ in lanes],
        "both": [c - n // 2 if i % 2 else 0 for i, (c, n) in enumerate(lanes)],
    }[kind]
    batch = make_batch(head_dim + block_size, lanes, *heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = cpu_attention(*batch[:4], lanes, scale, prompt_lens, kernel=kernel)
    expected = naive_attention(
        *[x.double() if x.is_floating_point() else x for x in batch],
        scale,
        rounded=dtype if dtype != torch.float32 else None,
    )
    torch.testing.assert_close(out.double(), expected, **CPU_TOLERANCE[dtype])
    # The decode entry point, with the reference's signature.
    ones = 7
    decode = cpu.BucketedAttention(kernel).decode(batch[0][:ones], *batch[1:3], batch[3][:ones], batch[4][:ones], scale)
    torch.testing.assert_close(decode.double(), expected[:ones], **CPU_TOLERANCE[dtype])
    if kernel and kind == "generated":  # one task per token and KV head: the same bits on one thread
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(cpu_attention(*batch[:4], lanes, scale, prompt_lens, kernel=kernel), out)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kv", [None] + KV8, ids=lambda kv: str(kv or "auto"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prompt_len", [0, 150, 300])
@KERNEL
def test_cpu_attention_token_depends_on_its_position_only(dtype, prompt_len, kv, kernel):
    # One 300-token sequence (9 query heads over 3 KV heads, blocks of 16), its tokens computed as one
    # prefill piece, as pieces cut at other points (mid-block too), and one by one as decodes, each time
    # beside other sequences of other lengths and kinds: every token's result is the same, bit for bit,
    # whether its sequence's first prompt_len tokens are its prompt (grouped) or not. What a block's former
    # owner can leave in the slots past the sequence's end changes nothing. The same with an 8-bit cache (kv).
    length, heads, kv_heads, dim, bs = 300, 9, 3, 64, 16
    others = [(5, 1), (700, 1), (33, 1), (129, 3), (400, 20)]
    others_prompts = [0, 700, 0, 129, 390]
    query, k_cache, v_cache, tables, _, _ = make_batch(3, [(length, length)] + others, heads, kv_heads, dim, bs, dtype)
    q, table, rest = query[:length], tables[:1], query[length:]
    scales = ()
    if kv:
        (k_cache, k_scale, _), (v_cache, v_scale, _) = quantized(k_cache, kv), quantized(v_cache, kv)
        scales = k_scale, v_scale
    # the slots past its end, as a former owner of the block gone NaN and huge left them
    slots = tables[0, length // bs] * bs + torch.arange(length % bs, bs)
    junk = torch.tensor([float("nan"), float("inf"), 1e30, -1e30])[torch.arange(len(slots)) % 4, None, None]
    cpu.store_finite_kv(*[junk.expand(len(slots), kv_heads, dim).to(dtype)] * 2, k_cache, v_cache, slots, *scales)

    def step(pieces):  # pieces of our sequence [(start, end)], then the others; one-token pieces first
        lanes = [(end, end - start) for start, end in pieces] + others
        order = sorted(range(len(lanes)), key=lambda i: lanes[i][1] > 1)
        rows = [q[a:b] for a, b in pieces] + list(rest.split([n for _, n in others]))
        t = torch.cat([table] * len(pieces) + [tables[1:]])
        prompts = [prompt_len] * len(pieces) + others_prompts
        out = cpu_attention(
            torch.cat([rows[i] for i in order]),
            k_cache,
            v_cache,
            t[order],
            [lanes[i] for i in order],
            dim**-0.5,
            [prompts[i] for i in order],
            scales,
            kernel,
        )
        out = out.split([lanes[i][1] for i in order])
        return [out[order.index(i)] for i in range(len(pieces))]

    whole = step([(0, length)])[0]
    assert not whole.isnan().any()
    for cuts in ([0, 37, 38, 128, 200, 300], [0, 1, 16, 255, 256, 257, 300]):
        torch.testing.assert_close(torch.cat(step(list(zip(cuts, cuts[1:])))), whole, rtol=0, atol=0)
    decodes = torch.cat([piece for p in range(0, length, 60) for piece in step([(t, t + 1) for t in range(p, p + 60)])])
    torch.testing.assert_close(decodes, whole, rtol=0, atol=0)


def test_cpu_store_kv_keeps_keys_and_values_finite():
    # A sequence gone NaN leaves no NaN or inf behind for the next owner of its blocks (see above).
    k_cache, v_cache = torch.zeros(2, 1, 4, 3, 2)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0])[:, None, None].expand(4, 3, 2)
    cpu.store_finite_kv(bad, -bad, k_cache, v_cache, torch.arange(4))
    assert torch.equal(k_cache[0], bad.nan_to_num(0.0, 0.0, 0.0)) and torch.equal(v_cache[0], -k_cache[0])
    for dtype in KV8:  # zeroed, then quantized
        codes, scales = torch.zeros(2, 1, 4, 3, 2, dtype=dtype), torch.zeros(2, 1, 4, 3)
        cpu.store_finite_kv(bad, -bad, *codes, torch.arange(4), *scales)
        stored = attention_cuda.dequantize_kv(codes, scales, torch.float32)
        assert torch.equal(stored[0, 0], k_cache[0]) and torch.equal(stored[1, 0], v_cache[0]), dtype


def test_store_kv_exact_and_skips_padding():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 6, 16, 3, 64, generator=g)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(2, 10, 3, 64, generator=g)
    slots = torch.randperm(6 * 16, generator=g)[:10]
    slots[[2, 5, 9]] = -1
    store_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_before[slot // 16, slot % 16] = key[t]
            v_before[slot // 16, slot % 16] = value[t]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


# the 8-bit KV cache (--kv-cache-dtype)


def fp8_round(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y (float64, within the format's range) rounded to the nearest value of fp8 dtype, ties to the even code:
    from the table of the format's codes, not by torch's cast."""
    mags = torch.arange(128, dtype=torch.uint8).view(dtype).double()
    mags = mags[mags.isfinite()]  # code i is the i-th magnitude, in increasing order
    a = y.abs().flatten()
    hi = torch.searchsorted(mags, a).clamp(max=len(mags) - 1)
    lo = (hi - 1).clamp(min=0)
    below, above = a - mags[lo], mags[hi] - a
    nearest = torch.where((above < below) | (above == below) & (hi % 2 == 0), hi, lo)
    return (mags[nearest] * y.sign().flatten()).view(y.shape)


def quantize_float64(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's quantization of float32 x, each float32 operation done in float64 and rounded to float32
    (a quotient or product of two float32 rounds once so): codes as float64 values, scales."""
    x, qmax = x.double(), attention_cuda.QMAX[dtype]
    amax = x.abs().amax(-1)
    inv = (qmax / amax).float().double()
    inv = torch.where(inv.isfinite(), inv, 0.0)
    y = (x * inv[..., None]).float().double()
    codes = y.round().clamp(-127, 127) if dtype == torch.int8 else fp8_round(y, dtype)
    return codes, (amax / qmax).float()


@pytest.mark.parametrize("dtype", KV8, ids=str)
def test_quantize_kv_matches_the_formula_in_float64(dtype):
    g = torch.Generator().manual_seed(1)
    # random vectors of magnitudes from 1e-30 to 1e30 (tiny values in fp8's subnormals), a zero vector, a vector
    # of one nonzero value, and vectors whose largest |value| is QMAX (x * inv = x) of values halfway between
    # two codes: ties, which round to the even code
    x = torch.randn(40, 3, 64, generator=g) * 10 ** torch.empty(40, 3, 1).uniform_(-30, 30, generator=g)
    x[0, 0], x[0, 1], x[0, 2] = 0.0, torch.eye(64)[5] * -3.0, torch.eye(64)[7] * 1e-40  # QMAX / 1e-40 is inf
    mags = (
        torch.arange(128, dtype=torch.uint8).view(dtype).double() if dtype != torch.int8 else torch.arange(128).double()
    )
    mags = mags[mags.isfinite()]
    halves = (mags[:-1] + mags[1:]) / 2
    ties = halves[torch.randint(len(halves), (6, 3, 64), generator=g)] * (torch.randint(2, (6, 3, 64)) * 2 - 1)
    ties[..., 0] = attention_cuda.QMAX[dtype]
    x = torch.cat((x, ties.float()))
    codes, scales = attention_cuda.quantize_kv(x, dtype)
    expected_codes, expected_scales = quantize_float64(x, dtype)
    assert codes.dtype == dtype and scales.dtype == torch.float32 and scales.shape == x.shape[:2]
    assert torch.equal(codes.double(), expected_codes) and torch.equal(scales, expected_scales)
    assert torch.equal(codes[0, 0].double(), torch.zeros(64)) and scales[0, 0] == 0  # no division by 0
    assert torch.equal(codes[0, 2].double(), torch.zeros(64)) and scales[0, 2] > 0  # no inf * x: codes 0, not NaN
    # bfloat16 keys are quantized from their float32 values
    assert torch.equal(
        attention_cuda.quantize_kv(x.bfloat16(), dtype)[0].double(), quantize_float64(x.bfloat16().float(), dtype)[0]
    )


# dtype: (largest relative error of a rounded normal value, largest absolute error below them in units of the
# scale: half the subnormals' spacing); int8: half a code
ROUNDING = {torch.float8_e4m3fn: (2**-4, 2**-10), torch.float8_e5m2: (2**-3, 2**-17), torch.int8: (0, 0.5)}


@pytest.mark.parametrize("dtype", KV8, ids=str)
def test_store_kv_8_bit_round_trip_within_the_types_bound(dtype):
    g = torch.Generator().manual_seed(2)
    codes = torch.zeros(2, 6, 16, 3, 64, dtype=dtype)
    scales = torch.zeros(2, 6, 16, 3)
    key, value = torch.randn(2, 10, 3, 64, generator=g) * 10 ** torch.empty(2, 10, 3, 1).uniform_(-4, 4, generator=g)
    slots = torch.randperm(6 * 16, generator=g)[:10]
    slots[[2, 5, 9]] = -1
    store_kv(key, value, *codes, slots, *scales)
    relative, absolute = ROUNDING[dtype]
    kept = slots >= 0
    for x, c, s in zip((key, value), codes, scales):
        index = slots[kept] // 16, slots[kept] % 16
        got, scale = attention_cuda.dequantize_kv(c[index], s[index], torch.float32), s[index][..., None]
        bound = (relative + 1e-6) * x[kept].abs() + (absolute + 1e-4) * scale  # float32's roundings: the 1e-6, 1e-4
        assert ((got - x[kept]).abs() <= bound).all()
        assert torch.equal(s[index], x[kept].abs().amax(-1) / attention_cuda.QMAX[dtype])
        untouched = torch.ones(6 * 16, dtype=torch.bool)
        untouched[slots[kept]] = False
        assert not c.view(-1, 3, 64)[untouched].float().any() and not s.view(-1, 3)[untouched].any()
    # gather_kv reads a sequence's tokens dequantized, in order
    table = torch.tensor([slots[0] // 16, 4, 5])
    assert torch.equal(
        attention_cuda.gather_kv(codes[0], table, 20, scales[0], torch.float64)[slots[0] % 16],
        attention_cuda.dequantize_kv(
            codes[0].view(-1, 3, 64)[slots[0]], scales[0].view(-1, 3)[slots[0]], torch.float64
        ),
    )


@pytest.mark.parametrize("dtype", KV8, ids=str)
def test_reference_attention_reads_8_bit_caches(dtype):
    # The reference on an 8-bit cache (decode and SDPA paths) against the float64 loop on its dequantized values.
    lanes = [(1, 1), (37, 1), (100, 1), (7, 7), (50, 9), (70, 16), (33, 33)]
    query, k_cache, v_cache, tables, lens, starts = make_batch(5, lanes, 9, 3, 64, 16)
    (k, k_scale, k_values), (v, v_scale, v_values) = quantized(k_cache, dtype), quantized(v_cache, dtype)
    expected = naive_attention(query.double(), k_values.double(), v_values.double(), tables, lens, starts, 0.125)
    assert (
        expected - naive_attention(query.double(), k_cache.double(), v_cache.double(), tables, lens, starts, 0.125)
    ).abs().max() > 1e-4  # the codes' rounding shows
    out = paged_attention_varlen(
        query, k, v, tables, lens, [n for _, n in lanes], lens.tolist(), 0.125, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    out = paged_attention(query[:3], k, v, tables[:3], lens[:3], 0.125, None, k_scale, v_scale)
    torch.testing.assert_close(out.double(), expected[:3], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv", KV8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_attention_reads_8_bit_caches(dtype, kv):
    # cpu.BucketedAttention on an 8-bit cache, prompt and generated tokens: bit for bit what it computes on a cache
    # of the values dequantized to the compute dtype (which test_cpu_attention_matches_naive checks), and in
    # float32 close to the float64 loop on them.
    lanes = [(1, 1), (15, 1), (300, 1), (1100, 1), (7, 7), (50, 9), (2 * cpu.KEY_BUCKET + 5, 40), (200, 150)]
    prompt_lens = [c - n // 2 if i % 2 else 0 for i, (c, n) in enumerate(lanes)]
    query, k_cache, v_cache, tables, lens, starts = make_batch(9, lanes, 9, 3, 64, 16, dtype)
    (k, k_scale, k_values), (v, v_scale, v_values) = quantized(k_cache, kv), quantized(v_cache, kv)
    out = cpu_attention(query, k, v, tables, lanes, 0.125, prompt_lens, (k_scale, v_scale))
    expected = cpu_attention(query, k_values.to(dtype), v_values.to(dtype), tables, lanes, 0.125, prompt_lens)
    assert torch.equal(out, expected)
    assert not torch.equal(expected, cpu_attention(query, k_cache, v_cache, tables, lanes, 0.125, prompt_lens))
    if dtype == torch.float32:
        naive = naive_attention(query.double(), k_values.double(), v_values.double(), tables, lens, starts, 0.125)
        torch.testing.assert_close(out.double(), naive, **CPU_TOLERANCE[dtype])
    decode = cpu.BucketedAttention().decode(query[:4], k, v, tables[:4], lens[:4], 0.125, None, k_scale, v_scale)
    values = [x.to(dtype) for x in (k_values, v_values)]
    assert torch.equal(decode, cpu.BucketedAttention().decode(query[:4], *values, tables[:4], lens[:4], 0.125))


@KERNEL
def test_cpu_attention_reads_a_bfloat16_cache_beside_float32(kernel):
    # --kv-cache-dtype bfloat16 beside float32: float32 queries on a bfloat16 cache, prompt and generated tokens,
    # give bit for bit what they give on a float32 cache of the same values (bfloat16's are exact in float32).
    lanes = [(1, 1), (15, 1), (300, 1), (1100, 1), (7, 7), (50, 9), (2 * cpu.KEY_BUCKET + 5, 40), (200, 150)]
    prompt_lens = [c - n // 2 if i % 2 else 0 for i, (c, n) in enumerate(lanes)]
    query, k_cache, v_cache, tables, _, _ = make_batch(9, lanes, 9, 3, 64, 16, torch.float32)
    k, v = k_cache.bfloat16(), v_cache.bfloat16()
    out = cpu_attention(query, k, v, tables, lanes, 0.125, prompt_lens, kernel=kernel)
    assert out.dtype == torch.float32
    assert torch.equal(
        out, cpu_attention(query, k.float(), v.float(), tables, lanes, 0.125, prompt_lens, kernel=kernel)
    )
    if kernel:  # a float32 cache beside bfloat16 queries is refused
        with pytest.raises(RuntimeError, match="token_attention"):
            cpu_attention(query.bfloat16(), k_cache, v_cache, tables, lanes, 0.125, kernel=True)


# the CUDA sources compile (no GPU needed)


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    """The kernel for sm_80 and sm_90 (nvcc), and the binding against torch's headers (C++ syntax only), with
    the flags torch's own build uses: C++20 and its NVCC defines (no implicit half/bfloat16 conversions). Both
    start at once, a core each; each test waits for its own."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    commands = {
        "kernel": [
            "nvcc",
            "-O3",
            "-std=c++20",
            *COMMON_NVCC_FLAGS,
            "-gencode",
            "arch=compute_80,code=sm_80",
            "-gencode",
            "arch=compute_90,code=sm_90",
            "-c",
            "attention_cuda/paged_attention.cu",
            "-o",
            str(tmp_path_factory.mktemp("nvcc") / "paged_attention.o"),
        ],
        "binding": [
            os.environ.get("CXX", "c++"),
            "-std=c++20",
            "-fsyntax-only",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            *(a for p in include_paths() for a in ("-isystem", p)),
            "attention_cuda/binding.cpp",
        ],
    }
    procs = {
        name: subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, cmd in commands.items()
    }
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def compiled(proc: subprocess.Popen) -> None:
    output = proc.communicate()[0]
    assert proc.returncode == 0, f"{' '.join(proc.args)}\n{output}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernel_compiles_for_sm80_and_sm90(compiles):
    compiled(compiles["kernel"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_binding_compiles_against_torch_headers(compiles):
    compiled(compiles["binding"])


# the kernel against the reference (GPU)

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-3),  # fp32 math, different summation order
    torch.float16: dict(atol=1e-3, rtol=3e-3),  # plus rounding of the output
    torch.bfloat16: dict(atol=2e-3, rtol=1.2e-2),
}


def kv_id(kv):
    return "auto" if kv is None else str(kv).removeprefix("torch.")


def stored(k_cache, v_cache, kv):
    """A make_batch cache as the kernel reads it (kv: an 8-bit type, or None: as it is) on the GPU: the caches and
    the scales' keyword arguments; and the values the reference reads (an 8-bit cache's dequantized in float32,
    the kernel's values exactly, so the bounds stay those of the query's dtype)."""
    if kv is None:
        return (k_cache.to(DEVICE), v_cache.to(DEVICE)), {}, (k_cache, v_cache)
    (k, k_scale, k_values), (v, v_scale, v_values) = quantized(k_cache, kv), quantized(v_cache, kv)
    scales = dict(k_scale=k_scale.to(DEVICE), v_scale=v_scale.to(DEVICE))
    return (k.to(DEVICE), v.to(DEVICE)), scales, (k_values, v_values)


def check_kernel(seed, lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_columns=2, kv=None, window=0):
    query, k_cache, v_cache, tables, context_lens, _ = make_batch(
        seed, [(n, 1) for n in lens], num_heads, num_kv_heads, head_dim, block_size, dtype, extra_columns=extra_columns
    )
    scale = head_dim**-0.5
    caches, scales, values = stored(k_cache, v_cache, kv)
    q, t, n = (x.to(DEVICE) for x in (query, tables, context_lens))
    out = attention_cuda.kernel.cuda_paged_attention(q, *caches, t, n, scale, **scales, window=window)
    assert out.shape == query.shape and out.dtype == dtype and out.device == q.device
    expected = paged_attention(query.float(), *(x.float() for x in values), tables, context_lens, scale, window=window)
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (32, 8), (8, 1)], ids=lambda h: f"{h[0]}:{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_matches_reference(dtype, head_dim, heads, block_size):
    # Contexts ending mid-block, on block and partition (512) boundaries, and several partitions.
    lens = [1, block_size - 1, block_size, block_size + 1, 100, 511, 512, 513, 1300]
    check_kernel(block_size + head_dim, lens, *heads, head_dim, block_size, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("kv", [None, torch.int8], ids=kv_id)
@pytest.mark.parametrize("head_dim, window", [(64, 5), (64, 600), (128, 512), (256, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_sliding_window_matches_reference(dtype, head_dim, window, kv):
    # Gemma 3's local layers: each lane reads its last `window` keys, its splits cut from the window's first; head_dim
    # 256 (Gemma 3's) in 16 and 8 bits (a float32 row of 256 spans two warps: refused).
    if head_dim == 256 and dtype == torch.float32 and kv is None:
        with pytest.raises(RuntimeError, match="head_dim"):
            check_kernel(3, [5], 4, 1, head_dim, 16, dtype, window=window)
        return
    check_kernel(
        window + head_dim,
        [1, 5, 6, 17, 100, 511, 513, 700, 1500],
        8,
        2 if head_dim < 256 else 1,
        head_dim,
        16,
        dtype,
        kv=kv,
        window=window,
    )


@pytest.mark.cuda
@pytest.mark.parametrize(
    "heads, block_size",
    [((4, 4), 8), ((9, 3), 16), ((32, 8), 32), ((8, 1), 16)],
    ids=lambda h: f"{h[0]}:{h[1]}" if isinstance(h, tuple) else f"block{h}",
)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv", KV8, ids=kv_id)
def test_kernel_8_bit_cache_matches_reference(kv, dtype, head_dim, heads, block_size):
    # 16 codes a lane (4 lanes a row at head_dim 64, so 8 tokens a warp), each row's scale beside its load.
    lens = [1, block_size - 1, block_size, block_size + 1, 100, 511, 512, 513, 1300]
    check_kernel(block_size + head_dim, lens, *heads, head_dim, block_size, dtype, kv=kv)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)], ids=["llama3-8b", "smollm2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_contexts_up_to_8192(dtype, shape):
    lens = [1, 2, 15, 16, 17, 255, 511, 512, 513, 1023, 1025, 2000, 4095, 4097, 8191, 8192]
    check_kernel(1, lens, *shape, 16, dtype)


@pytest.mark.cuda
def test_kernel_long_contexts_use_partitions():
    # A lane of len tokens takes ceil(len / 512) splits, at most 64, so a split covers max(512, len / 64)
    # tokens; at 40000 and 131072 tokens they are 625 and 2048 long, starting mid-block.
    check_kernel(2, [1, 32768, 40000, 131072], 8, 2, 128, 16, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("kv", [None, *KV8], ids=kv_id)
@pytest.mark.parametrize("given", [True, False], ids=["max_context_len", "None"])
def test_kernel_lane_independent_of_batch(given, kv):
    # A lane's split count comes from its own context, so its output is bitwise the same alone (in a
    # table just wide enough) as beside a 40000-token lane, whose 64 splits size the grid and scratch.
    lens = [1, 100, 513, 5000, 40000]
    query, k_cache, v_cache, tables, context_lens, _ = make_batch(
        11, [(n, 1) for n in lens], 8, 2, 128, 16, torch.bfloat16
    )
    (k, v), scales, values = stored(k_cache, v_cache, kv)
    q, t, n = (x.to(DEVICE) for x in (query, tables, context_lens))
    together = attention_cuda.kernel.cuda_paged_attention(q, k, v, t, n, 0.1, max(lens) if given else None, **scales)
    expected = reference_decode(query, *values, tables, context_lens, 0.1)
    torch.testing.assert_close(together.float().cpu(), expected, **TOLERANCE[torch.bfloat16])
    for i, ctx in enumerate(lens[:-1]):
        row = t[i : i + 1, : math.ceil(ctx / 16)].contiguous()
        alone = attention_cuda.kernel.cuda_paged_attention(
            q[i : i + 1], k, v, row, n[i : i + 1], 0.1, ctx if given else None, **scales
        )
        assert torch.equal(alone, together[i : i + 1]), f"lane {i} ({ctx} tokens)"


@pytest.mark.cuda
def test_kernel_strided_query_and_empty_lane():
    # The query as a view into a fused QKV projection output; a padding lane (context 0) gives zeros.
    query, k_cache, v_cache, tables, lens, _ = make_batch(3, [(40, 1), (700, 1), (1, 1)], 9, 3, 64, 16, torch.bfloat16)
    lens[2] = 0
    qkv = torch.randn(3, 15, 64, dtype=torch.bfloat16)
    qkv[:, :9] = query
    out = attention_cuda.kernel.cuda_paged_attention(
        qkv.to(DEVICE)[:, :9], k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE), 0.125
    )
    expected = reference_decode(query[:2], k_cache, v_cache, tables[:2], lens[:2], 0.125)
    torch.testing.assert_close(out[:2].float().cpu(), expected, **TOLERANCE[torch.bfloat16])
    assert bool((out[2] == 0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("kv", [None, *KV8], ids=kv_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_store_kv_exact(dtype, kv):
    # An 8-bit cache: the kernel's codes and scales are the reference's bit for bit, ties included (token 1's rows:
    # QMAX, so x * inv is x, then values halfway between two codes, which go to the even one).
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn(2, 9, 16, 8, 128, generator=g).to(dtype)
    qkv = torch.randn(20, (32 + 16) * 128, generator=g).to(dtype)  # fused projection: rows are strided
    key, value = qkv[:, 32 * 128 : 40 * 128].view(20, 8, 128), qkv[:, 40 * 128 :].view(20, 8, 128)
    slots = torch.randperm(9 * 16, generator=g)[:20]
    slots[::4] = -1
    scales = []
    if kv is not None:  # codes of every byte, scales of any value, to be overwritten where stored
        k_cache, v_cache = torch.randint(256, (2, 9, 16, 8, 128), generator=g, dtype=torch.uint8).view(kv)
        scales = list(torch.randn(2, 9, 16, 8, generator=g))
        codes = torch.arange(128, dtype=torch.uint8).view(kv).float() if kv != torch.int8 else torch.arange(128.0)
        codes = codes[codes.isfinite()]
        halfway = (codes[1:] + codes[:-1]) / 2
        key[1], value[1] = halfway[torch.randint(len(halfway), (2, 8, 128), generator=g)] * (-1) ** torch.arange(128)
        key[1, :, 0] = value[1, :, 0] = attention_cuda.QMAX[kv]
    expected = [x.clone() for x in (k_cache, v_cache, *scales)]
    store_kv(key, value, *expected[:2], slots, *expected[2:])
    on_device = [x.to(DEVICE) for x in (k_cache, v_cache, *scales)]
    attention_cuda.kernel.cuda_store_kv(
        key.to(DEVICE), value.to(DEVICE), *on_device[:2], slots.to(DEVICE), *on_device[2:]
    )
    for got, want in zip(on_device, expected):  # as bytes, so that NaN codes compare too
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.cuda
def test_kernel_argument_errors():
    query, k_cache, v_cache, tables, lens, _ = make_batch(5, [(20, 1), (3, 1)], 4, 2, 64, 16)
    q, k, v, t, n = (x.to(DEVICE) for x in (query, k_cache, v_cache, tables, lens))
    attention = attention_cuda.kernel.cuda_paged_attention
    cases = [
        (lambda: attention(q.double(), k, v, t, n, 1.0), "unsupported dtype"),
        (lambda: attention(q.half(), k, v, t, n, 1.0), "dtype must match"),
        (
            lambda: attention(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), t, n, 1.0),
            "head_dim must be 64 or 128",
        ),
        (
            lambda: attention(q, k[:4].reshape(1, 64, 2, 64), v[:4].reshape(1, 64, 2, 64), t, n, 1.0),
            "block_size must be 8, 16 or 32",
        ),
        (lambda: attention(q[:, :3], k, v, t, n, 1.0), "multiple of num_kv_heads"),
        (lambda: attention(q, k.transpose(0, 1), v.transpose(0, 1), t, n, 1.0), "contiguous"),
        (lambda: attention(q, k, v, t.long(), n, 1.0), "block_tables must be contiguous int32"),
        (lambda: attention(q, k, v, t, n.long(), 1.0), "context_lens must be contiguous int32"),
        (lambda: attention(q, k, v, t[:1], n, 1.0), "block_tables must be"),
        (lambda: attention(q, k, v, t.cpu(), n, 1.0), "must be a CUDA tensor"),
        (lambda: attention(q.cpu(), k, v, t, n, 1.0), "must be a CUDA tensor"),
        (lambda: attention(q, k, v, t, n, 1.0, -1), "max_context_len must be between 0"),
        (lambda: attention(q, k, v, t, n, 1.0, t.shape[1] * 16 + 1), "max_context_len must be between 0"),
        (
            lambda: attention_cuda.kernel.cuda_store_kv(
                q[:, :2], q[:, :2], k, v, torch.zeros(2, dtype=torch.int32, device=q.device)
            ),
            "slot_mapping must be contiguous int64",
        ),
        (
            lambda: attention_cuda.kernel.cuda_store_kv(
                q[:, :3], q[:, :3], k, v, torch.zeros(2, dtype=torch.int64, device=q.device)
            ),
            "key/value must be",
        ),
    ]
    k8, v8, scales = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn), torch.ones(k.shape[:3], device=q.device)
    slots = torch.zeros(2, dtype=torch.int64, device=q.device)
    cases += [
        (lambda: attention(q, k8, v8, t, n, 1.0), "an 8-bit cache needs k_scale and v_scale"),
        (lambda: attention(q, k, v, t, n, 1.0, k_scale=scales, v_scale=scales), "are for an 8-bit cache"),
        (lambda: attention(q, k8, v.to(torch.int8), t, n, 1.0, k_scale=scales, v_scale=scales), "dtype must match"),
        (lambda: attention(q, k8, v8, t, n, 1.0, k_scale=scales[:1], v_scale=scales), "k_scale must be contiguous"),
        (lambda: attention(q, k8, v8, t, n, 1.0, k_scale=scales, v_scale=scales.double()), "v_scale must be"),
        (lambda: attention_cuda.kernel.cuda_store_kv(q[:, :2], q[:, :2], k8, v8, slots), "an 8-bit cache needs"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.cuda
def test_kernel_replays_in_cuda_graph():
    # Decode on GPU runs under CUDA graphs: no host sync or host-side read of the inputs may hide
    # in the call, and a replay must see the inputs' new contents.
    query, k_cache, v_cache, tables, lens, _ = make_batch(
        6, [(30, 1), (900, 1), (5, 1)], 32, 8, 128, 16, torch.bfloat16
    )
    q, k, v, t, n = (x.to(DEVICE) for x in (query, k_cache, v_cache, tables, lens))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_cuda.kernel.cuda_paged_attention(q, k, v, t, n, 0.1)  # warm-up (and build) outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_cuda.kernel.cuda_paged_attention(q, k, v, t, n, 0.1)
    new_query = torch.randn(query.shape).to(torch.bfloat16)
    new_lens = torch.tensor([31, 517, 1], dtype=torch.int32)
    q.copy_(new_query)
    n.copy_(new_lens)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_decode(new_query, k_cache, v_cache, tables, new_lens, 0.1)
    torch.testing.assert_close(out.float().cpu(), expected, **TOLERANCE[torch.bfloat16])


@pytest.mark.cuda
def test_reference_runs_on_cuda_tensors():
    # model.py runs prefill through the reference on the GPU: same result as on CPU.
    lanes = [(1, 1), (37, 1), (50, 9), (7, 7)]
    batch = make_batch(8, lanes, 6, 2, 64, 16)
    expected = varlen(*batch, 0.125)
    out = varlen(*(t.to(DEVICE) for t in batch), 0.125)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-3, rtol=2e-3)
    decode = make_batch(9, [(1, 1), (37, 1)], 6, 2, 64, 16)[:5]
    torch.testing.assert_close(
        paged_attention(*(t.to(DEVICE) for t in decode), 0.125).cpu(),
        paged_attention(*decode, 0.125),
        atol=2e-3,
        rtol=2e-3,
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
