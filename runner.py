"""The model runner: the model and its KV cache on a device, and one step's scheduled sequences turned
into batch tensors, a forward pass and sampled tokens. CUDA graphs replay decode steps on a GPU."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

import cpu
import parallel
import weights
from config import EngineConfig
from kv_cache import KVCache, KVShape, slots
from model import BatchMeta, ModelConfig, Transformer
from sequence import SamplingParams, Sequence

TOP_P_HEAD = 1024  # on CPU, the likeliest tokens _draw sorts first for top-p


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


@dataclass
class StepBatch:
    """One step's tokens as host lists: what `tensors` sends to the device and rank 0 broadcasts to the others."""
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded with 0 to the longest
    context_lens: list[int]
    sample_rows: list[int]
    query_lens: list[int]
    prompt_lens: list[int]


class ModelRunner:
    """The model on its device. With tensor_parallel_size > 1 this is one rank's shard: rank 0 (the engine's
    runner) spawns the others, which run `run_worker`; `rank` and `address` are theirs."""

    def __init__(self, config: EngineConfig, rank: int = 0, address: str | None = None,
                 model_config: ModelConfig | None = None):
        self.config = c = config
        device = torch.device(c.device if c.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
        if c.quantization and device.type != "cpu":
            raise ValueError("--quantization int4 runs on CPU only (torch's 4-bit CPU matmul)")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {c.device}: torch sees {torch.cuda.device_count()} CUDA devices here")
        self.tp = parallel.TensorParallel(c.tensor_parallel_size, device.type, c.torch_threads, rank, address) \
            if c.tensor_parallel_size > 1 or parallel.launched_by_torchrun() else None
        self.rank, tp_size = (self.tp.rank, self.tp.size) if self.tp else (0, 1)
        self.device = self.tp.device if self.tp else device
        default = torch.float32 if self.device.type == "cpu" and not cpu.has_bf16_units() else torch.bfloat16
        self.dtype = default if c.dtype == "auto" else getattr(torch, c.dtype)
        if self.device.index is not None:
            torch.cuda.set_device(self.device)  # kernels and graph captures use the current device's stream
        # Rank 0 loads (checking the checkpoint against tp_size) before it spawns anyone, so a bad setting
        # fails once; spawned ranks, and every rank under torchrun, join first: no rank waits to join.
        joined_first = self.tp and (self.rank > 0 or parallel.launched_by_torchrun())
        if joined_first:
            self.tp.start()
        try:
            self._load(model_config, tp_size)
            if self.tp:
                if not joined_first:
                    self.tp.start(spawn=(run_worker, c, self.model_config))
                self.tp.barrier()  # every rank has loaded; from here on they run in step
                self.model.all_reduce = self.tp.all_reduce
            self._allocate_kv()
        except Exception as e:
            if not self.tp:
                raise
            failure = self.tp.fail(e)  # the other ranks wait on us: end them
            self.tp.close()
            if isinstance(e, ValueError):
                raise
            raise failure from e

    def _load(self, model_config: ModelConfig | None, tp_size: int) -> None:
        """The weights (this rank's part of them) into a Transformer on the device."""
        c = self.config
        if c.dummy_weights:
            if model_config is None and c.model not in weights.PRESETS:
                raise ValueError(f"--dummy-weights needs a preset name, one of {sorted(weights.PRESETS)}")
            self.model_config = model_config or weights.PRESETS[c.model]
            self.checkpoint_path = None
            state = weights.dummy_weights(self.model_config, self.dtype, c.seed, self.device, self.rank, tp_size)
        else:
            self.checkpoint_path = weights.resolve_checkpoint(c.model, c.model_path)
            if self.rank == 0:
                print(f"loading {self.checkpoint_path}", file=sys.stderr)
            self.model_config, state = weights.load_weights(self.checkpoint_path, self.dtype, self.rank, tp_size)
        mc = self.model_config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{mc.max_position_embeddings}")
        self.model = Transformer(mc, self.max_model_len, self.device, tp_size)
        self.model.load_hf_state_dict(state)
        if self.device.type == "cpu":
            cpu.optimize(self.model, c.quantization, c.max_num_seqs)

    def _allocate_kv(self) -> None:
        """The KV pool: a fixed size, or what the memory knobs leave once the weights are in."""
        c, mc = self.config, self.model_config
        kv = KVShape(mc.num_hidden_layers, self.model.layers[0].kv_heads, mc.head_dim)
        per_block = kv.bytes_per_block(c.block_size, self.dtype)
        if c.num_kv_blocks is not None:
            self.num_kv_blocks = c.num_kv_blocks
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks torch freed while loading would count as in use
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self._profile_peak_memory(kv)
            self.num_kv_blocks = kv_cache_bytes(total, free, peak, c.gpu_memory_utilization) // per_block
        else:
            self.num_kv_blocks = int(c.kv_cache_memory * 2**30) // per_block
        if self.tp:  # one block table serves every rank: each gets the pool the tightest one has room for
            self.num_kv_blocks = self.tp.smallest(self.num_kv_blocks)
        if self.num_kv_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block is {per_block} bytes): raise "
                             "--kv-cache-memory or --gpu-memory-utilization, or set --num-kv-blocks")
        self.num_swap_blocks = int(c.swap_space * 2**30) // per_block if c.preemption_mode == "swap" else 0
        try:
            self.kv_cache = KVCache(kv, self.num_kv_blocks, c.block_size, self.dtype, self.device, self.num_swap_blocks)
        except (RuntimeError, MemoryError) as e:  # the allocator's message names no knob
            raise ValueError(f"cannot allocate {self.num_kv_blocks} KV blocks and {self.num_swap_blocks} swap blocks "
                             f"of {per_block} bytes (--num-kv-blocks, --kv-cache-memory, --swap-space): "
                             f"{str(e).splitlines()[0][:200]}") from None
        self.graphs = DecodeGraphs(self) if self.device.type == "cuda" and not c.enforce_eager else None
        if self.graphs and self.tp:  # they hold the NCCL communicator: gone before it is destroyed
            self.tp.on_close.append(self.graphs.graphs.clear)

    def _profile_steps(self) -> list[list[tuple[Sequence, int]]]:
        """The steps whose activations peak highest: a prefill chunk of the whole token budget ending a max_model_len
        context (attending to every key), and max_num_seqs decodes there; all on block 0 (values do not matter).
        A chunk after cached tokens takes SDPA's masked path, which can cost more than a whole prompt's causal one
        (GQA with a mask may fall back to the math backend: [heads, chunk, context] scores); when the budget holds
        a whole max_model_len prompt, a chunk one token shorter is profiled too."""
        c, length = self.config, self.max_model_len
        ids, table = [0] * length, [0] * -(-length // c.block_size)  # shared: only their lengths are read

        def seq(n: int) -> tuple[Sequence, int]:
            s = Sequence("profile", ids, SamplingParams(), block_table=table, num_computed_tokens=length - n)
            return s, n
        chunks = sorted({min(c.max_num_batched_tokens, n) for n in (length, length - 1)}, reverse=True)
        return [[seq(n)] for n in chunks] + [[seq(1) for _ in range(c.max_num_seqs)]]

    def _profile_peak_memory(self, kv: KVShape) -> int:
        """GPU bytes the worst step allocates beyond those in use before (weights): what the KV pool must leave free."""
        dev = self.device
        scratch = KVCache(kv, 1, self.config.block_size, self.dtype, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        for step in self._profile_steps():
            ids, pos, meta, sampled = self.prepare(step)
            logits = self.model(ids, pos, meta, scratch.layers)
            if self.rank == 0:  # the only rank that samples
                sample(logits, sampled)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del scratch
        torch.cuda.empty_cache()
        return peak

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, BatchMeta,
                                                                       list[Sequence]]:
        batch, sampled = self.batch(scheduled)
        return *self.tensors(batch), sampled

    def batch(self, scheduled: list[tuple[Sequence, int]]) -> tuple[StepBatch, list[Sequence]]:
        """The step's tokens flattened, sequence after sequence (one-token pieces first), and the sequences
        sampled this step (those whose piece reaches their last token)."""
        scheduled = sorted(scheduled, key=lambda item: item[1] > 1)
        input_ids, positions, slot_mapping, block_tables, context_lens = [], [], [], [], []
        sample_rows, sampled = [], []
        for seq, n in scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            slot_mapping += slots(seq.block_table, self.config.block_size, begin, end)
            block_tables.append(seq.block_table)
            context_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return StepBatch(input_ids, positions, slot_mapping, tables, context_lens, sample_rows,
                         [n for _, n in scheduled], [seq.num_prompt_tokens for seq, _ in scheduled]), sampled

    def tensors(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        """Input ids, positions and metadata on the device (via send); only rank 0 samples, so only its LM head runs."""
        i32, i64, dev = torch.int32, torch.int64, self.device
        meta = BatchMeta(send(b.slot_mapping, i64, dev), send(b.block_tables, i32, dev),
                         send(b.context_lens, i32, dev), send(b.sample_rows if self.rank == 0 else [], i64, dev),
                         max(b.query_lens), max(b.context_lens), b.query_lens, b.context_lens, b.prompt_lens)
        return send(b.input_ids, i64, dev), send(b.positions, i64, dev), meta

    def run(self, scheduled: list[tuple[Sequence, int]], swap_out: list[tuple[int, int]] = (),
            swap_in: list[tuple[int, int]] = ()) -> list[tuple[Sequence, int, TokenLogprob | None, str | None]]:
        """The step's swaps, then a forward pass writing the scheduled sequences' new K/V: each sampled one's
        next token or why sampling failed. Every rank runs the step broadcast here; failing is fatal (WorkerFailure)."""
        batch, sampled = self.batch(scheduled) if scheduled else (None, [])
        try:
            if self.tp:
                self.tp.broadcast((swap_out, swap_in, batch))
            logits = self.execute(swap_out, swap_in, batch)
        except Exception as e:
            if self.tp:
                raise self.tp.fail(e) from e
            raise
        return list(zip(sampled, *sample(logits, sampled))) if batch else []

    def execute(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                batch: StepBatch | None) -> torch.Tensor | None:
        """Every rank's part of a step: the swaps, then the forward pass; the sampled rows' logits (none off rank 0)."""
        self.kv_cache.swap(swap_out, swap_in)
        if batch is None:
            return None
        ids, pos, meta = self.tensors(batch)
        if self.graphs and meta.max_query_len == 1:  # the largest graph holds max_num_seqs rows
            # A graph computes every row; a one-token prefill piece that is not its prompt's end samples none.
            return self.graphs.run(ids, pos, meta)[meta.sample_rows]
        return self.model(ids, pos, meta, self.kv_cache.layers)


def run_worker(config: EngineConfig, model_config: ModelConfig | None = None, rank: int = 0,
               address: str | None = None) -> None:
    """A tensor-parallel rank other than 0: load its part, then run each step rank 0 broadcasts until it says stop
    (None) or goes away. A failure ends the worker with one line (rank 0 tells its users), or none if rank 0 is gone."""
    try:
        runner = ModelRunner(config, rank, address, model_config)
        weights.read_gguf.cache_clear()  # the parsed header (vocabulary included) is the tokenizer's, on rank 0
        try:
            while (step := runner.tp.broadcast(None)) is not None:
                runner.execute(*step)
        finally:
            runner.tp.close()
    except Exception as e:
        if parallel.rank_0_gone():
            os._exit(1)
        sys.exit(f"laneserve: tensor-parallel worker: {type(e).__name__}: {e}")


def kv_cache_bytes(total: int, free: int, peak: int, utilization: float) -> int:
    """The KV pool's bytes: gpu_memory_utilization of total, less what is in use (weights, other processes) and peak."""
    return int(total * utilization) - (total - free) - peak


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None],
                                                               list[str | None]]:
    """Next token per sequence: plain greedy rows by one batched max (the first maximal index, as argmax;
    widening bfloat16 first would be exact, so it changes no order); the rest each on its own row in float32,
    drawn from its own generator so that a seeded request draws the same numbers whatever batch it is in. A row
    that fails (NaN logits, say) fails its own sequence alone: the third list says why, per sequence."""
    best = logits.max(dim=-1)  # NaN anywhere in a row makes its max NaN
    tokens = best.indices
    logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # row -> chosen, top ids, top values
    errors: list[str | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        p = seq.params
        processed = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 or p.logit_bias
                         or seq.num_tokens - seq.num_prompt_tokens < p.min_tokens)
        if not (p.temperature or p.logprobs is not None or processed):
            continue
        try:
            raw = logits[i].float()
            logit = _process(raw.clone(), seq) if processed else raw
            if p.temperature:
                tokens[i] = _draw(logit / p.temperature, p, seq.generator)
            elif processed:
                tokens[i] = logit.argmax()
            if p.logprobs is not None:
                # From the model's own distribution, before penalties, bias and temperature, as vLLM's default.
                lp = raw.log_softmax(-1)
                top = lp.topk(p.logprobs)
                logprobs[i] = lp.gather(0, tokens[i:i + 1]), top.indices, top.values
        except Exception as e:
            errors[i] = f"sampling failed ({type(e).__name__}: {e})"
            logprobs.pop(i, None)
    # One transfer: token ids (exact in float64), NaN flags and every logprob in one tensor: n ids, n flags,
    # then per sequence with logprobs its token's logprob, its k top ids and their k logprobs.
    n = len(seqs)
    flat = torch.cat([t.double() for t in (tokens, best.values.isnan(),
                                           *(t for row in logprobs.values() for t in row))]).tolist()
    ids, at = [int(t) for t in flat[:n]], 2 * n
    out: list[TokenLogprob | None] = [None] * n
    for i in logprobs:
        k = seqs[i].params.logprobs
        top = list(zip(map(int, flat[at + 1:at + 1 + k]), flat[at + 1 + k:at + 1 + 2 * k]))
        out[i], at = TokenLogprob(ids[i], flat[at], top), at + 1 + 2 * k
    errors = [e or ("the model's logits are NaN" if flat[n + i] else None) for i, e in enumerate(errors)]
    return ids, out, errors


def _process(logit: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row of logits (float32, in place) as its request asks: stop tokens banned before min_tokens,
    logit_bias added, then vLLM's repetition penalty and OpenAI's presence and frequency penalties."""
    p, dev, i64 = seq.params, logit.device, torch.int64
    if seq.num_tokens - seq.num_prompt_tokens < p.min_tokens and seq.stop_ids:
        logit[send(sorted(seq.stop_ids), i64, dev)] = float("-inf")
    if p.logit_bias:
        logit[send(list(p.logit_bias), i64, dev)] += send(list(p.logit_bias.values()), logit.dtype, dev)
    if p.repetition_penalty != 1:
        seen = send(seq.token_ids, i64, dev).unique()
        x = logit[seen]
        logit[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = send(seq.output_token_ids, i64, dev)
        counts = torch.zeros_like(logit).index_add_(0, out, torch.ones_like(out, dtype=logit.dtype))
        logit -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logit


def send(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or list of equal-length lists) as a tensor on device, through pinned memory: the copy never waits
    on a GPU. Through numpy, which reads nested lists twice as fast as torch.tensor (64 block tables of 512 entries,
    an 8K context each: 1.3 ms instead of 2.4, a step's host time that CUDA graphs do not hide)."""
    pinned = device.type == "cuda"
    return torch.tensor(np.array(values), dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


def _draw(row: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """A token drawn from softmax(row) after top-k, min-p and top-p. NaN becomes 0 first: a device
    cannot raise for one row (a CUDA assert would end every sequence), and sample() flags the row."""
    row, ids = row.nan_to_num(), None  # ids: the vocabulary ids of row's entries, when not all of them
    if 0 < p.top_k < len(row):
        # The others get probability 0; ties with the k-th stay, as in vLLM. On CPU draw among these alone
        # (faster, README); on a GPU mask the others instead: how many tie would have to be read back.
        keep = row >= row.topk(p.top_k).values[-1]
        if row.is_cuda:
            row = row.masked_fill(~keep, float("-inf"))
        else:
            ids = keep.nonzero()[:, 0]
            row = row[ids]
    probs = row.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
        probs /= probs.sum()  # top_p measures the mass of the tokens min_p leaves, as in vLLM
    if p.top_p < 1:
        # Only the likeliest tokens can make the nucleus. On CPU, where sorting a whole vocabulary is slow
        # (README), sort just the TOP_P_HEAD likeliest, and all only if they fall short of top_p.
        head, order = probs.topk(probs.numel() if probs.is_cuda else min(TOP_P_HEAD, probs.numel()))
        if len(order) < len(probs) and float(head.sum()) < p.top_p:
            head, order = probs.sort(descending=True)
        # Drop a token once the mass before it already reaches top_p; the first always stays (a top_p
        # that rounds to 0 in float32 would drop it too).
        drop = head.cumsum(-1) - head >= p.top_p
        drop[0].fill_(False)  # not `= False`, which copies from the host and waits on a GPU
        probs, ids = head.masked_fill(drop, 0), order if ids is None else ids[order]
    # Inverse CDF, one uniform u in (0, 1] per draw (torch.multinomial draws one per vocabulary entry): the
    # first token whose cumulative mass reaches u * total, never one of mass 0 (it adds nothing to the sum).
    cdf = probs.double().cumsum(0)
    u = 1 - torch.rand((), dtype=torch.float64, device=row.device, generator=generator)
    token = torch.searchsorted(cdf, u * cdf[-1])
    return token if ids is None else ids.gather(0, token.view(1))[0]  # ids[token] would read token back


class DecodeGraphs:
    """CUDA graphs for decode steps, which skip the per-kernel launch cost that dominates small batches: one per
    batch size of a ladder, a step of n sequences replaying the smallest with room for n, padded with sequences
    that read nothing (context 0) and write nothing (slot -1). Every tensor a graph reads is a static buffer below."""

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
            sample_rows=torch.arange(n, device=dev), max_query_len=1, max_context_len=runner.max_model_len,
            query_lens=[1] * n, host_context_lens=[], prompt_lens=[])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Captured on a stream of our own device: torch.cuda.graph's default stream is made once per process, on
        # the device current then, and a capture there would miss this device's work (engines on two GPUs).
        stream = torch.cuda.Stream(dev)
        m = self.meta
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            meta = BatchMeta(m.slot_mapping[:size], m.block_tables[:size], m.context_lens[:size],
                             m.sample_rows[:size], 1, m.max_context_len, [1] * size, [], [])
            args = (self.ids[:size], self.pos[:size], meta, runner.kv_cache.layers)
            runner.model(*args)  # warm up: lazy initialisation must not happen during capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = runner.model(*args)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(dev)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        """Logits of all n rows, sampled or not."""
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
