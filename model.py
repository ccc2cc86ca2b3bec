"""The network: a Llama-family decoder that runs one flattened batch of lanes over the paged KV cache."""
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import attention_cuda


@dataclass
class ModelConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1 frequency scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False



@dataclass
class BatchMeta:
    """Where each flattened token of one step lives. Lane i owns token rows
    query_start_loc[i]:query_start_loc[i+1]; context_lens[i] counts its cached tokens after this step."""
    slot_mapping: torch.Tensor     # [num_tokens] int64, physical KV slot per new token, -1 = padding
    block_tables: torch.Tensor     # [num_lanes, max_blocks] int32, unused entries 0
    context_lens: torch.Tensor     # [num_lanes] int32
    query_start_loc: torch.Tensor  # [num_lanes + 1] int32
    sample_rows: torch.Tensor      # [num_sampled] int64, rows whose logits are needed this step
    max_query_len: int             # 1: every lane decodes one token (no host sync, graph-capturable)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3.1's rescaling: long wavelengths are slowed by
    `factor`, short ones kept, and the band between is interpolated smoothly."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if not s:
        return inv_freq
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen = old_ctx / s["low_freq_factor"]
    high_wavelen = old_ctx / s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s["factor"], inv_freq)
    smooth = (old_ctx / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout: the pairs are (i, i + head_dim/2)). x: [tokens, heads, dim];
    sin comes with its first half negated (Transformer.rope_sin), so rotating half is a plain roll:
    x * cos + (-x2, x1) * sin == x * cos + (x2, x1) * (-sin1, sin2)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """On CPU, computed as the LayerNorm of [x, -x]: its mean is 0 and its variance mean(x^2), so its
    first half is x / sqrt(mean(x^2) + eps). LayerNorm is one fused kernel on CPU where F.rms_norm is
    eight ops; measured about 1 ms less per step at batch 1, the same values to float32 rounding."""
    if x.is_cuda:
        return F.rms_norm(x, weight.shape, weight, eps)
    d = x.shape[-1]
    return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), None, None, eps)[..., :d] * weight


INT4_GROUP = 32  # inputs sharing one scale and zero, as in GGUF's Q4_0/Q4_1 blocks


class Int4Weight(NamedTuple):
    """A [n, k] weight in 4 bits (--quantization int4, CPU): w = (q - 8) * scale + zero, one scale
    and zero per INT4_GROUP inputs, in torch's packed layout for _weight_int4pack_mm_for_cpu."""
    packed: torch.Tensor        # [n, k / 2] uint8
    scales_zeros: torch.Tensor  # [k / INT4_GROUP, n, 2] in the activations' dtype


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Round-to-nearest, asymmetric, as GGUF's Q4_1: each group's min and max become q = 0 and 15.
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
    return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros)


def linear(x: torch.Tensor, w: torch.Tensor | Int4Weight) -> torch.Tensor:
    if isinstance(w, Int4Weight):
        return torch._weight_int4pack_mm_for_cpu(x, w.packed, INT4_GROUP, w.scales_zeros)
    if w.is_mkldnn:  # prepacked by Transformer.prepack_for_cpu
        if x.shape[0] == 1 and x.shape[1] > 1024:
            # oneDNN takes a separate path for a single row, which sums long rows (over 1024 inputs,
            # measured) in another order than the batched path: a lane alone would get other bits
            # than in a batch. Computed as two rows it gets the batched path's.
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), w, None, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return F.linear(x, w)


def _weight(*shape: int) -> nn.Parameter:
    # A placeholder on the meta device: it costs no memory until the checkpoint's tensor replaces it.
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class Block(nn.Module):
    """One decoder layer. Q, K and V share one matmul, as do the MLP's gate and up projections."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.attn_norm = _weight(c.hidden_size)
        self.qkv = _weight(q + 2 * kv, c.hidden_size)
        self.o = _weight(c.hidden_size, q)
        self.mlp_norm = _weight(c.hidden_size)
        self.gate_up = _weight(2 * c.intermediate_size, c.hidden_size)
        self.down = _weight(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMeta,
                k_cache: torch.Tensor, v_cache: torch.Tensor, decode: Callable) -> torch.Tensor:
        """decode: paged_attention's signature, for one-token lanes (Transformer.forward picks it)."""
        c = self.c
        n, d, h, kv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        qkv = linear(rms_norm(x, self.attn_norm, c.rms_norm_eps), self.qkv).view(n, -1, d)
        # Q and K heads take the same rotation, so they are rotated together in one pass.
        qk = apply_rope(qkv[:, :h + kv], cos, sin)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv:]
        store = attention_cuda.cuda_store_kv if x.is_cuda else attention_cuda.store_kv
        store(k, v, k_cache, v_cache, meta.slot_mapping)
        scale = 1.0 / math.sqrt(d)
        if meta.max_query_len == 1:
            o = decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        else:
            o = attention_cuda.paged_attention_varlen(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                      meta.query_start_loc, scale, decode)
        x = x + linear(o.reshape(n, -1), self.o)
        gate_up, i = linear(rms_norm(x, self.mlp_norm, c.rms_norm_eps), self.gate_up), c.intermediate_size
        return x + linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], self.down)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, max_model_len: int, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.embed = _weight(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = _weight(config.hidden_size)
        self.lm_head = self.embed if config.tie_word_embeddings else _weight(config.vocab_size, config.hidden_size)
        freqs = torch.outer(torch.arange(max_model_len, device=device).float(), rope_inv_freq(config).to(device))
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        sin = freqs.sin()
        sin[:, :config.head_dim // 2] *= -1  # see apply_rope
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take weights in Hugging Face Llama naming (what weights.py yields), fusing QKV and
        gate/up, onto the rope tables' device. Consumes sd to keep peak memory at one copy."""
        device = self.rope_cos.device

        def put(module: nn.Module, attr: str, *names: str) -> None:
            t = torch.cat([sd.pop(n) for n in names]) if len(names) > 1 else sd.pop(names[0])
            setattr(module, attr, nn.Parameter(t.to(device), requires_grad=False))

        put(self, "embed", "model.embed_tokens.weight")
        put(self, "norm", "model.norm.weight")
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
            self.lm_head = self.embed
        else:
            put(self, "lm_head", "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            put(layer, "qkv", *(p + f"self_attn.{w}_proj.weight" for w in "qkv"))
            put(layer, "o", p + "self_attn.o_proj.weight")
            put(layer, "gate_up", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer, "down", p + "mlp.down_proj.weight")
            put(layer, "attn_norm", p + "input_layernorm.weight")
            put(layer, "mlp_norm", p + "post_attention_layernorm.weight")
        if sd:
            raise ValueError(f"unexpected weights in checkpoint: {sorted(sd)[:5]}")

    def matmul_weights(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every matmul weight: each layer's four, then the LM head."""
        return [(layer, n) for layer in self.layers for n in ("qkv", "o", "gate_up", "down")] + [(self, "lm_head")]

    @torch.no_grad()
    def quantize_int4_for_cpu(self) -> None:
        """Replace the layers' matmul weights by their 4-bit form (quantize_int4): a quarter of the
        memory traffic of bfloat16, measured 3x faster matmuls for one lane here, but 2.2x slower for
        64 (the kernel widens the codes on every call), hence an option, not the default. The LM head
        keeps the model's dtype, as GGUF files keep it at 8 bits. One kernel serves every batch size,
        so a lane's result still never depends on its batch."""
        for module, name in self.matmul_weights()[:-1]:
            w = quantize_int4(getattr(module, name))
            delattr(module, name)  # a Parameter slot takes only Parameters
            setattr(module, name, w)

    @torch.no_grad()
    def prepack_for_cpu(self, batch_size: int) -> None:
        """Reorder every (not quantized) matmul weight once into oneDNN's blocked layout for bfloat16
        on CPU, instead of on every call: 15-50% faster matmuls measured here (most at small batches),
        same results bit for bit. A tied LM head gets its own packed copy; the embedding stays a plain table."""
        for module, name in self.matmul_weights():
            if isinstance(w := getattr(module, name), torch.Tensor):
                setattr(module, name, nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, batch_size),
                                                   requires_grad=False))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMeta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits (in the model's dtype) for meta.sample_rows only:
        the LM head is the largest matmul per token and mid-prompt rows never need it."""
        x = F.embedding(input_ids, self.embed)
        cos = self.rope_cos[positions].to(x.dtype)[:, None, :]
        sin = self.rope_sin[positions].to(x.dtype)[:, None, :]
        # Decode attention: our kernel on CUDA, else the reference, whose block-table work for an
        # all-decode step is planned here once for every layer.
        decode = attention_cuda.cuda_paged_attention if x.is_cuda else attention_cuda.paged_attention
        if meta.max_query_len == 1 and not x.is_cuda:
            decode = partial(decode, plan=attention_cuda.plan_decode(meta.block_tables, meta.context_lens,
                                                                     kv_caches[0][0]))
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, k_cache, v_cache, decode)
        x = rms_norm(x[meta.sample_rows], self.norm, self.config.rms_norm_eps)
        return linear(x, self.lm_head)
