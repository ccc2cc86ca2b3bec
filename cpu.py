"""CPU fast paths, an appendix to model.py and attention_cuda: the same arithmetic as the textbook forms
there, arranged to run faster on a CPU (and, with --quantization int4, the checkpoint's own 4-bit
weights). optimize() swaps them into a loaded model once; the README has the measurements."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from model import Transformer

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


def optimize(model: Transformer, max_num_seqs: int, quantization: str | None) -> None:
    """Swap the fast CPU forms into model, in place."""
    model.decode = DecodeAttention()
    _replace(model, nn.RMSNorm, FusedRMSNorm)
    if quantization == "int4":  # the layers only: GGUF files keep the LM head at 8 bits, so do we
        _replace(model.layers, nn.Linear, lambda linear: Int4Linear(linear.weight))
    # oneDNN packs bfloat16 weights only where these instructions exist; elsewhere F.linear it is.
    flags = _cpu_flags()
    if model.embed.weight.dtype == torch.bfloat16 and ({"avx512bw", "avx512vl", "avx512dq"} <= flags
                                                       or "avx_ne_convert" in flags):
        _replace(model, nn.Linear, lambda linear: PackedLinear(linear.weight, max_num_seqs))


def _replace(root: nn.Module, kind: type, make) -> None:
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


class FusedRMSNorm(nn.Module):
    """RMSNorm as the LayerNorm of [x, -x]: its mean is 0 and its variance mean(x^2), so its first half
    is x / sqrt(mean(x^2) + eps). LayerNorm is one fused kernel on CPU where F.rms_norm is eight ops."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), None, None, self.eps)[..., :d] * self.weight


class PackedLinear(nn.Module):
    """A bfloat16 weight reordered once into oneDNN's blocked layout, instead of on every call; the same
    bits. A tied LM head gets its own packed copy; the embedding stays a plain table."""

    def __init__(self, weight: torch.Tensor, batch_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight, batch_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.shape[1] > 1024:
            # oneDNN takes a separate path for a single row, which sums long rows (over 1024 inputs) in
            # another order than its batched path: a sequence alone would get other bits than in a batch.
            # Computed as two rows it gets the batched path's.
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.weight, None, "none", [], "")[:1]
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


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Blocks `blocks` (sequence after sequence, equally many each) as [num_seqs, tokens, kv_heads, dim].
    A block is one contiguous row, so this is a row index_select: a memcpy per block."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks).view(num_seqs, -1, *cache.shape[2:])


class DecodeAttention:
    """attention_cuda.paged_attention's signature and result, all sequences in one padded batch. What
    depends only on the block tables is planned by the first layer's call of a step and reused by the
    others (they get the same block_tables tensor)."""

    def __init__(self):
        self.block_tables: torch.Tensor | None = None  # what the plan below was made for

    def plan(self, block_tables: torch.Tensor, context_lens: torch.Tensor, k_cache: torch.Tensor,
             max_context_len: int) -> None:
        block_size, kv_heads, dev = k_cache.shape[1], k_cache.shape[2], k_cache.device
        # Whole blocks: a length that is not a multiple of the block size would leave the gathered K a
        # strided slice, which the matmul below would first copy.
        num_blocks = -(-max_context_len // block_size)
        self.block_tables, self.blocks = block_tables, block_tables[:, :num_blocks].flatten()
        pad = torch.arange(num_blocks * block_size, device=dev) >= context_lens.to(dev)[:, None]
        # [num_seqs, 1, tokens]: 0 on a sequence's own tokens, -inf on the padding.
        self.bias = torch.zeros(pad.shape, dtype=k_cache.dtype, device=dev).masked_fill_(pad, float("-inf"))[:, None]
        self.spread = torch.eye(kv_heads, dtype=k_cache.dtype, device=dev).view(1, kv_heads, 1, kv_heads, 1)

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 max_context_len: int | None = None) -> torch.Tensor:
        if block_tables is not self.block_tables:
            self.plan(block_tables, context_lens, k_cache, max_context_len or int(context_lens.max()))
        seqs, heads, dim = query.shape
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        k = gather_blocks(k_cache, self.blocks, seqs).flatten(2)  # [seqs, tokens, kv_heads * dim]
        v = gather_blocks(v_cache, self.blocks, seqs).flatten(2)
        # Grouped-query attention without copying K/V per head: each query head is laid out across all
        # kv_heads * dim columns, zero outside its own KV head's slice (a product with the identity, exact),
        # so one batched matmul with the keys as gathered gives every head its scores.
        q = (query.view(seqs, kv_heads, group, 1, dim) * self.spread).view(seqs, heads, kv_heads * dim)
        # Scale and pad mask ride in the matmul; softmax runs in the cache's dtype (it widens inside).
        # Pad keys are masked out, and the cache is zero-initialised, so they cannot leak NaN into the sum.
        probs = torch.baddbmm(self.bias, q, k.transpose(1, 2), alpha=scale).softmax(-1)
        # Backwards: head h's output is the slice of its row that belongs to its KV head.
        out = torch.bmm(probs, v).view(seqs, kv_heads, group, kv_heads, dim).diagonal(dim1=1, dim2=3)
        return out.permute(0, 3, 1, 2).reshape(seqs, heads, dim)
