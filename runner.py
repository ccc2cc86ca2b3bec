"""The model runner: the model and its KV cache on a device, and one step's scheduled sequences turned
into batch tensors, a forward pass and sampled tokens. CUDA graphs replay decode steps on a GPU."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import cpu
import weights
from config import EngineConfig
from kv_cache import KVCache, KVShape, slots
from model import BatchMeta, Transformer
from sequence import SamplingParams, Sequence


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = c = config
        self.device = torch.device(c.device if c.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
        on_cpu = self.device.type == "cpu"
        default = torch.float32 if on_cpu and not cpu.has_bf16_units() else torch.bfloat16
        self.dtype = default if c.dtype == "auto" else getattr(torch, c.dtype)
        if c.quantization and not on_cpu:
            raise ValueError("--quantization int4 runs on CPU only (torch's 4-bit CPU matmul)")
        if c.dummy_weights:
            if c.model not in weights.PRESETS:
                raise ValueError(f"--dummy-weights needs a preset name, one of {sorted(weights.PRESETS)}")
            self.model_config = weights.PRESETS[c.model]
            self.checkpoint_path = None
            state = weights.dummy_weights(self.model_config, self.dtype, c.seed, self.device)
        else:
            self.checkpoint_path = weights.resolve_checkpoint(c.model, c.model_path)
            print(f"loading {self.checkpoint_path}", file=sys.stderr)
            self.model_config, state = weights.load_weights(self.checkpoint_path, self.dtype)
        mc = self.model_config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.model = Transformer(mc, self.max_model_len, self.device)
        self.model.load_hf_state_dict(state)
        if on_cpu:
            cpu.optimize(self.model, c.max_num_seqs, c.quantization)

        kv = KVShape(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
        per_block = kv.bytes_per_block(c.block_size, self.dtype)
        if c.num_kv_blocks is not None:
            self.num_kv_blocks = c.num_kv_blocks
        elif self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            self.num_kv_blocks = int(total * c.gpu_memory_utilization - self._profile_peak_memory(kv)) // per_block
        else:
            self.num_kv_blocks = int(c.kv_cache_memory * 2**30) // per_block
        if self.num_kv_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block is {per_block} bytes): raise "
                             "--kv-cache-memory or --gpu-memory-utilization, or set --num-kv-blocks")
        self.num_swap_blocks = int(c.swap_space * 2**30) // per_block if c.preemption_mode == "swap" else 0
        self.kv_cache = KVCache(kv, self.num_kv_blocks, c.block_size, self.dtype, self.device, self.num_swap_blocks)
        self.graphs = DecodeGraphs(self) if self.device.type == "cuda" and not c.enforce_eager else None

    def _profile_peak_memory(self, kv: KVShape) -> int:
        """GPU bytes in use at the peak of a prefill at the full token budget, before the KV pool
        exists: what gpu_memory_utilization must leave to weights and activations."""
        n, bs, dev = self.config.max_num_batched_tokens, self.config.block_size, self.device
        scratch = KVCache(kv, 1, bs, self.dtype, dev)  # one block, which the whole block table names
        seq = Sequence("profile", [0] * n, SamplingParams(), block_table=[0] * -(-n // bs))
        ids, pos, meta, _ = self.prepare([(seq, n)])
        torch.cuda.reset_peak_memory_stats(dev)
        self.model(ids, pos, meta, scratch.layers)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, BatchMeta,
                                                                       list[Sequence]]:
        """The step's tokens flattened, sequence after sequence: input ids, positions, their metadata,
        and the sequences sampled this step (those whose chunk reaches their last token)."""
        input_ids, positions, slot_mapping, block_tables, context_lens, starts = [], [], [], [], [], [0]
        sample_rows, sampled = [], []
        for seq, n in scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            slot_mapping += slots(seq.block_table, self.config.block_size, begin, end)
            block_tables.append(seq.block_table)
            context_lens.append(end)
            starts.append(starts[-1] + n)
            if end == seq.num_tokens:
                sample_rows.append(starts[-1] - 1)
                sampled.append(seq)
        width = max(len(t) for t in block_tables)
        dev = self.device
        meta = BatchMeta(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                      device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            max_query_len=max(n for _, n in scheduled))
        return torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), meta, sampled

    def run(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """One forward pass over the scheduled sequences, writing their new K/V; the next token of each
        sampled one."""
        ids, pos, meta, sampled = self.prepare(scheduled)
        if self.graphs and meta.max_query_len == 1 and len(scheduled) <= self.graphs.sizes[-1]:
            logits = self.graphs.run(ids, pos, meta)
        else:
            logits = self.model(ids, pos, meta, self.kv_cache.layers)
        return list(zip(sampled, *sample(logits, sampled)))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token per sequence: plain greedy rows by one batched max (the first maximal index, as
    argmax; widening bfloat16 first would be exact, so it changes no order); the rest each on its own
    row in float32, drawn from its own generator so that a seeded request draws the same numbers
    whatever batch it is in."""
    tokens = logits.max(dim=-1).indices.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        p, g = seq.params, seq.generator
        if not (p.temperature or p.presence_penalty or p.frequency_penalty or p.logprobs is not None):
            continue
        logit = logits[i].float()
        if p.presence_penalty or p.frequency_penalty:
            out = torch.tensor(seq.output_token_ids, dtype=torch.int64, device=logits.device)
            counts = torch.bincount(out, minlength=logit.shape[-1]).to(logit.dtype)
            logit -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            tokens[i] = int(logit.argmax())
        if p.temperature:
            row = logit / p.temperature
            if p.top_k > 0:
                kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = row.softmax(-1)
            if p.min_p > 0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
            if p.top_p < 1:
                sorted_probs, order = probs.sort(descending=True)
                # Drop a token once the mass before it already reaches top_p; the first always stays.
                drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
                probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0))
            tokens[i] = int(torch.multinomial(probs, 1, generator=g))
        if (k := p.logprobs) is not None:
            # Reported from the model's distribution (after penalties, before temperature), as vLLM does.
            lp = logit.log_softmax(-1)
            top = lp.topk(k) if k else None
            logprobs[i] = TokenLogprob(tokens[i], float(lp[tokens[i]]),
                                       list(zip(top.indices.tolist(), top.values.tolist())) if k else [])
    return tokens, logprobs


class DecodeGraphs:
    """CUDA graphs for decode steps, captured once per batch size of a ladder: a step of n sequences
    replays the smallest graph with room for n, padded with sequences that read nothing (context 0)
    and write nothing (slot -1). Replaying skips the per-kernel launch cost that dominates small
    decode batches. Every tensor the graph reads lives in the static buffers below."""

    def __init__(self, runner: ModelRunner):
        c, dev = runner.config, runner.device
        self.sizes = [s for s in (1, 2, 4, 8, *range(16, 513, 16)) if s < c.max_num_seqs] + [c.max_num_seqs]
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.meta = BatchMeta(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(n, -(-runner.max_model_len // c.block_size), dtype=torch.int32, device=dev),
            context_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            sample_rows=torch.arange(n, device=dev), max_query_len=1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            meta = BatchMeta(self.meta.slot_mapping[:size], self.meta.block_tables[:size],
                             self.meta.context_lens[:size], self.meta.query_start_loc[:size + 1],
                             self.meta.sample_rows[:size], 1)
            args = (self.ids[:size], self.pos[:size], meta, runner.kv_cache.layers)
            runner.model(*args)  # warm up: lazy initialisation must not happen during capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = runner.model(*args)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(dev)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.ids[:n] = ids
        self.pos[:n] = pos
        self.meta.slot_mapping[:n] = meta.slot_mapping
        self.meta.slot_mapping[n:size] = -1
        self.meta.block_tables[:n, :width] = meta.block_tables
        self.meta.context_lens[:n] = meta.context_lens
        self.meta.context_lens[n:size] = 0
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
