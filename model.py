"""The network: a decoder of the Llama, Qwen3 or Gemma 3 family (a config field per difference) that runs one
flattened batch of sequences over the paged KV cache."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

import attention_cuda
import attention_cuda.kernel


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
    # Llama 3.1 RoPE scaling {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}, or None
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm per head on Q and K, before RoPE
    # Gemma 3: embeddings scaled by sqrt(hidden_size), a norm after attention and after the MLP as well as before,
    # GeGLU (tanh GELU), norms computed with 1 + w (weights.load_state_dict adds the 1 to the weights).
    gemma: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale 1 / sqrt(this); None: head_dim
    # Local layers attend to the last sliding_window keys (their own included) and rotate by rope_local_theta;
    # every sliding_window_pattern-th layer (Gemma 3: the 6th, 12th, ...) is global. 0: every layer global.
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    rope_local_theta: float = 10000.0

    def is_local(self, layer: int) -> bool:
        return bool(self.sliding_window and (layer + 1) % self.sliding_window_pattern)


@dataclass
class BatchMeta:
    """Where each flattened token of one step lives. Sequence i owns the next query_lens[i] token rows;
    context_lens[i] counts its computed tokens (K/V in the cache) after this step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, physical KV slot per new token, -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, unused entries 0
    context_lens: torch.Tensor  # [num_seqs] int32
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose logits are needed this step
    max_query_len: int  # 1: every sequence decodes one token (graph-capturable)
    max_context_len: int  # bounds the decode kernel's scratch
    # The host's copies of what attention cuts the batch by, so that no layer waits on the device to read
    # them. Sequences with one query token come first (the decode path takes them together).
    query_lens: list[int]
    host_context_lens: list[int]
    prompt_lens: list[int]  # cpu.BucketedAttention computes prompt tokens otherwise than generated ones


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies (a local layer's: base rope_local_theta, unscaled), with Llama 3.1's rescaling: long
    wavelengths are slowed by `factor`, short ones kept, and the band between is interpolated smoothly."""
    d = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if not s or local:
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
    """Rotate-half RoPE (HF layout: pairs (i, i + head_dim/2)) on x [tokens, heads, dim]. With sin's first half
    negated (Transformer.rope_sin), rotating half is a roll: x*cos + (-x2, x1)*sin == x*cos + (x2, x1)*(-sin1, sin2)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


class Block(nn.Module):
    """One decoder layer. Q, K and V share one matmul, as do the MLP's gate and up projections. Under tensor
    parallelism (tp_size ranks) it holds this rank's heads and MLP columns only."""

    def __init__(self, c: ModelConfig, tp_size: int = 1, local: bool = False):
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads // tp_size, max(1, c.num_key_value_heads // tp_size)
        self.head_dim = d = c.head_dim
        q_width, kv_width, inter = self.heads * d, self.kv_heads * d, c.intermediate_size // tp_size
        self.local, self.window = local, c.sliding_window if local else 0
        self.scale = 1.0 / math.sqrt(c.query_pre_attn_scalar or d)
        self.act = partial(F.gelu, approximate="tanh") if c.gemma else F.silu

        # On the meta device the weights cost no memory until the checkpoint's tensors replace them.
        def norm(on: bool, n: int = c.hidden_size) -> nn.Module:
            return nn.RMSNorm(n, c.rms_norm_eps, device="meta") if on else nn.Identity()

        self.attn_norm, self.mlp_norm = norm(True), norm(True)
        self.q_norm, self.k_norm = (norm(True, d), norm(True, d)) if c.qk_norm else (None, None)
        self.attn_post_norm, self.mlp_post_norm = norm(c.gemma), norm(c.gemma)
        self.qkv = nn.Linear(c.hidden_size, q_width + 2 * kv_width, bias=False, device="meta")
        self.o = nn.Linear(q_width, c.hidden_size, bias=False, device="meta")
        self.gate_up = nn.Linear(c.hidden_size, 2 * inter, bias=False, device="meta")
        self.down = nn.Linear(inter, c.hidden_size, bias=False, device="meta")

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMeta,
        kv_cache: tuple[torch.Tensor, ...],
        ops: "Transformer",
    ) -> torch.Tensor:
        """kv_cache: this layer's (k_cache, v_cache), or (k_cache, v_cache, k_scale, v_scale) in 8 bits. ops: the
        model, whose store_kv, attention and all_reduce the CPU and tensor-parallel paths replace."""
        n, d, h, kv = x.shape[0], self.head_dim, self.heads, self.kv_heads
        k_cache, v_cache, *scales = kv_cache
        qkv = self.qkv(self.attn_norm(x)).view(n, -1, d)
        # Q and K heads take the same rotation, so they are rotated together in one pass.
        qk = qkv[:, : h + kv]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), 1)
        qk = apply_rope(qk, cos, sin)
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv :]
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, *scales)
        o = ops.attention(q, k_cache, v_cache, meta, self.scale, *scales, window=self.window)
        x = x + self.attn_post_norm(ops.all_reduce(self.o(o.reshape(n, -1))))
        gate, up = self.gate_up(self.mlp_norm(x)).view(n, 2, -1).unbind(1)
        return x + self.mlp_post_norm(ops.all_reduce(self.down(self.act(gate) * up)))


class Transformer(nn.Module):
    """The decoder. With tp_size > 1 its blocks hold one rank's shard, and all_reduce (set by the runner)
    adds the ranks' partial outputs; the embedding and LM head stay whole on every rank."""

    def __init__(self, config: ModelConfig, max_model_len: int, device: torch.device | str = "cpu", tp_size: int = 1):
        super().__init__()
        self.config = config
        # Given its (meta) weight, the embedding skips reset_parameters, which on the meta device would
        # import torch._dynamo (slow) in every process that builds a model.
        shape = (config.vocab_size, config.hidden_size)
        self.embed = nn.Embedding(*shape, _weight=torch.empty(shape, device="meta"))
        self.layers = nn.ModuleList(Block(config, tp_size, config.is_local(i)) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, config.rms_norm_eps, device="meta")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device="meta")
        # [global, local] tables (the local one only with sliding windows) of [max_model_len, head_dim]
        freqs = torch.stack(
            [
                torch.outer(torch.arange(max_model_len, device=device).float(), rope_inv_freq(config, local).to(device))
                for local in (False, True)[: 1 + bool(config.sliding_window)]
            ]
        )
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        sin = freqs.sin()
        sin[..., : config.head_dim // 2] *= -1  # see apply_rope
        self.register_buffer("rope_sin", sin, persistent=False)
        # Paged attention: our kernel on CUDA, else the pure-PyTorch reference (cpu.py swaps in its own).
        cuda = torch.device(device).type == "cuda"
        self.store_kv = attention_cuda.kernel.cuda_store_kv if cuda else attention_cuda.store_kv
        self.decode = attention_cuda.kernel.cuda_paged_attention if cuda else attention_cuda.paged_attention
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: BatchMeta,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """Each query token attends to its own sequence's cached keys up to its position (the last `window` of
        them, if set): the decode path when every sequence brings one token, else the reference's varlen form."""
        if meta.max_query_len == 1:
            return self.decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                meta.max_context_len,
                k_scale,
                v_scale,
                window,
            )
        return attention_cuda.paged_attention_varlen(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            meta.host_context_lens,
            scale,
            self.decode,
            k_scale,
            v_scale,
            window,
        )

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: BatchMeta,
        kv_caches: list[tuple[torch.Tensor, ...]],
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits (in the model's dtype) for meta.logits_indices only:
        the LM head is the largest matmul per token and mid-prompt rows need it only for prompt logprobs."""
        x = self.embed(input_ids)
        if self.config.gemma:  # the scale rounded to the model's dtype first, as in transformers
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        cos = self.rope_cos[:, positions].to(x.dtype)[:, :, None, :]
        sin = self.rope_sin[:, positions].to(x.dtype)[:, :, None, :]
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos[int(layer.local)], sin[int(layer.local)], meta, kv_cache, self)
        return self.lm_head(self.norm(x[meta.logits_indices]))
