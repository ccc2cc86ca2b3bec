"""The step loop: requests in, one scheduled forward pass per step, tokens out."""
from __future__ import annotations

import random
import sys
import uuid
from dataclasses import dataclass, field

import torch

import weights
from kv_cache import BlockManager, KVCache, kv_bytes_per_block
from model import BatchMeta, Transformer
from scheduler import Scheduler, SchedulerConfig, Sequence, Status
from tokenizer import IncrementalDetokenizer, load_tokenizer


def _cpu_has_bf16_units() -> bool:
    """AMX or AVX512-BF16: there, batched bfloat16 matmuls measured 2x (batch 64) to 1.3x (batch 1)
    faster end to end than float32. Without them bfloat16 is emulated and slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _require(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = off
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0   # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # ... and this times how often it was generated
    logprobs: int | None = None     # None: off; k: the chosen token's logprob and the top k

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [(self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (or -1 for off)"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.max_tokens >= 1, "max_tokens must be >= 1"),
                  (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
                  (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
                  (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")]
        _require(checks)


@dataclass
class EngineConfig:
    model: str = weights.DEFAULT_MODEL
    model_path: str | None = None
    dummy_weights: bool = False
    device: str = "auto"            # cuda when available, else cpu
    dtype: str = "auto"             # bfloat16 on cuda and on cpus with bf16 matrix units, else float32
    quantization: str | None = None   # "int4": 4-bit matmul weights (cpu), faster for few lanes
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    preemption_mode: str = "recompute"
    swap_space: float = 4.0           # GiB of host memory for swapped-out KV
    enable_prefix_caching: bool = False
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact pool size; else sized from memory below
    kv_cache_memory: float = 2.0      # GiB of KV pool on cpu
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False       # cuda: no CUDA graphs for decode steps
    trace: bool = False               # keep a per-step lane trace (tests, teaching)

    def validate(self) -> None:
        """Refuse impossible settings at startup, with a message naming the knob."""
        checks = [
            (self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= self.block_size,
             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least one block "
             f"({self.block_size} tokens)"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be >= 1"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
            (self.kv_cache_memory > 0, "kv_cache_memory must be > 0"),
            (self.swap_space >= 0, "swap_space must be >= 0"),
            (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
            (self.scheduling in ("continuous", "static"), "scheduling must be 'continuous' or 'static'"),
            (self.preemption_mode in ("recompute", "swap"), "preemption_mode must be 'recompute' or 'swap'"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"unknown device {self.device!r}"),
            (self.dtype in ("auto", "float32", "float16", "bfloat16"),
             "dtype must be auto, float32, float16 or bfloat16"),
            (self.quantization in (None, "int4"), f"unknown quantization {self.quantization!r} (int4 or none)"),
        ]
        _require(checks)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str          # text released by this step
    finished: bool
    finish_reason: str | None  # "stop" or "length", as in OpenAI's API
    logprob: TokenLogprob | None = None  # of the token this step produced, when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class LaneStep:
    """One lane in one step of the trace; kv_tokens counts prompt + generated tokens."""
    request_id: str
    num_new_tokens: int
    num_generated: int
    kv_tokens: int
    finished: bool


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = c = config or EngineConfig(**kwargs)
        c.validate()
        self.device = torch.device(c.device if c.device != "auto" else
                                   "cuda" if torch.cuda.is_available() else "cpu")
        default = torch.bfloat16 if self.device.type == "cuda" or _cpu_has_bf16_units() else torch.float32
        self.dtype = default if c.dtype == "auto" else getattr(torch, c.dtype)
        if c.quantization and self.device.type != "cpu":
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
        # Random weights borrow the default model's tokenizer: ids past its vocabulary decode to nothing.
        self.tokenizer = load_tokenizer(self.checkpoint_path or weights.resolve_checkpoint())
        self.max_model_len = c.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{self.model_config.max_position_embeddings}")
        self.model = Transformer(self.model_config, self.max_model_len, self.device)
        self.model.load_hf_state_dict(state)
        if c.quantization:
            self.model.quantize_int4_for_cpu()
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            self.model.prepack_for_cpu(c.max_num_seqs)

        per_block = kv_bytes_per_block(self.model_config, c.block_size, self.dtype)
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        elif self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            num_blocks = int(total * c.gpu_memory_utilization - self._profile_peak_memory()) // per_block
        else:
            num_blocks = int(c.kv_cache_memory * 2**30) // per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (one block is {per_block} bytes): raise "
                             "--kv-cache-memory or --gpu-memory-utilization, or set --num-kv-blocks")
        num_swap_blocks = int(c.swap_space * 2**30) // per_block if c.preemption_mode == "swap" else 0
        self.kv_cache = KVCache(self.model_config, num_blocks, c.block_size, self.dtype, self.device,
                                num_swap_blocks)
        self.block_manager = BlockManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_seqs, c.max_num_batched_tokens,
                                                   c.enable_chunked_prefill, c.scheduling, c.preemption_mode),
                                   self.block_manager, BlockManager(num_swap_blocks, c.block_size))
        self.graphs = (DecodeGraphs(self) if self.device.type == "cuda" and not c.enforce_eager else None)
        self.requests: dict[str, Sequence] = {}
        self.rng = random.Random(c.seed)
        self.trace: list[list[LaneStep]] = []
        self.held: list[RequestOutput] = []  # static mode: finished, waiting for the batch to end
        self.num_prompt_tokens = 0      # prompt tokens run through the model (cache hits excluded)
        self.num_generation_tokens = 0

    def _profile_peak_memory(self) -> int:
        """GPU bytes in use at the peak of a prefill at the full token budget, before the KV pool
        exists: what gpu_memory_utilization must leave to weights and activations."""
        n = self.config.max_num_batched_tokens
        bs = self.config.block_size
        scratch = KVCache(self.model_config, 1, bs, self.dtype, self.device)
        meta = BatchMeta(slot_mapping=torch.full((n,), -1, device=self.device),  # writes nothing
                         block_tables=torch.zeros(1, -(-n // bs), dtype=torch.int32, device=self.device),
                         context_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
                         query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
                         sample_rows=torch.tensor([n - 1], device=self.device), max_query_len=n)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model(torch.zeros(n, dtype=torch.int64, device=self.device),
                   torch.arange(n, device=self.device), meta, scratch.layers)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def stats(self) -> dict[str, float]:
        """Counters and gauges for the server's /metrics."""
        s, bm = self.scheduler, self.block_manager
        return {"num_running": len(s.running), "num_waiting": len(s.waiting), "num_swapped": len(s.swapped),
                "kv_usage": 1 - bm.num_free_blocks / bm.num_blocks, "num_preemptions": s.num_preemptions,
                "prefix_cache_queries": s.prefix_queries, "prefix_cache_hits": s.prefix_hits,
                "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generation_tokens}

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it joins the running batch at the next step with room for it."""
        params = params or SamplingParams()
        ids = (self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos_token) if isinstance(prompt, str)
               else list(prompt))
        if not ids:
            raise ValueError("prompt is empty")
        if min(ids) < 0 or max(ids) >= self.model_config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.model_config.vocab_size})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        blocks = -(-(len(ids) + params.max_tokens) // self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {blocks} KV blocks; the pool has only "
                             f"{self.block_manager.num_blocks}")
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) exceeds max_num_batched_tokens "
                             f"({self.config.max_num_batched_tokens}) with chunked prefill off")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(request_id, ids, params)
        seq.generator = torch.Generator(self.device).manual_seed(
            params.seed if params.seed is not None else self.rng.getrandbits(63))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

    def step(self) -> list[RequestOutput]:
        """schedule -> build batch tensors -> forward -> sample -> update. Returns an output for
        every lane that produced a token this step."""
        plan = self.scheduler.schedule()
        self.kv_cache.swap(plan.swap_out, plan.swap_in)
        scheduled = plan.scheduled
        if not scheduled:
            return []
        input_ids, positions, slots, block_tables, context_lens, starts = [], [], [], [], [], [0]
        sample_rows, sampled = [], []
        for seq, n in scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            slots += self.block_manager.slots(seq.block_table, begin, end)
            block_tables.append(seq.block_table)
            context_lens.append(end)
            starts.append(starts[-1] + n)
            if end == seq.num_tokens:  # the chunk reaches the lane's last token: sample its next one
                sample_rows.append(starts[-1] - 1)
                sampled.append(seq)
        width = max(len(t) for t in block_tables)
        dev = self.device
        meta = BatchMeta(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                                      dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            max_query_len=max(n for _, n in scheduled))
        ids, pos = torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev)
        if self.graphs and meta.max_query_len == 1 and len(scheduled) <= self.graphs.sizes[-1]:
            logits = self.graphs.run(ids, pos, meta)
        else:
            logits = self.model(ids, pos, meta, self.kv_cache.layers)
        for seq, n in scheduled:
            begin = seq.num_computed_tokens
            self.num_prompt_tokens += max(0, min(begin + n, seq.num_prompt_tokens) - begin)
            self.block_manager.publish(seq.block_table, seq.token_ids, begin, begin + n)
            seq.num_computed_tokens += n
        outputs = []
        tokens, logprobs = sample(logits, sampled)
        for seq, token, logprob in zip(sampled, tokens, logprobs):
            outputs.append(self._append_token(seq, token, logprob))
        if self.config.trace:
            self.trace.append([LaneStep(s.request_id, n, s.num_tokens - s.num_prompt_tokens, s.num_tokens,
                                        s.status is Status.FINISHED) for s, n in scheduled])
        if self.config.scheduling == "static":
            # Request-level batching answers a batch all at once: a finished lane's result waits
            # (its slot idle) until the batch's longest lane is done.
            self.held += [o for o in outputs if o.finished]
            outputs = [o for o in outputs if not o.finished]
            if not self.scheduler.running:
                outputs, self.held = outputs + self.held, []
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        p = seq.params
        delta = ""
        reason = None
        if token in p.stop_token_ids or (token in self.tokenizer.stop_token_ids and not p.ignore_eos):
            reason = "stop"
        elif token not in self.tokenizer.stop_token_ids:
            delta = seq.detokenizer.feed(token)
            if seq.detokenizer.stopped:
                reason = "stop"
        if reason is None and (len(seq.token_ids) - seq.num_prompt_tokens >= p.max_tokens
                               or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if not seq.detokenizer.stopped:  # release text held back as a possible stop-string start
                delta += seq.detokenizer.flush()
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return RequestOutput(seq.request_id, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                             seq.detokenizer.text, delta, reason is not None, reason, logprob,
                             seq.num_cached_tokens)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token per lane: plain greedy rows by one batched max (the first maximal index, as
    argmax; on bfloat16 measured 2x faster than widening to float32 first, and widening is exact,
    so it changes no order); the rest each on its own row in float32, sampled from its own
    generator so that a seeded request draws the same numbers whatever batch it is in."""
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
    """CUDA graphs for decode steps, captured once per batch size of a ladder: a step of n lanes
    replays the smallest graph with room for n, padded with lanes that read nothing (context 0)
    and write nothing (slot -1). Replaying skips the per-kernel launch cost that dominates small
    decode batches. Every tensor the graph reads lives in the static buffers below."""

    def __init__(self, engine: Engine):
        c, dev = engine.config, engine.device
        self.sizes = [s for s in (1, 2, 4, 8, *range(16, 513, 16)) if s < c.max_num_seqs] + [c.max_num_seqs]
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.meta = BatchMeta(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(n, -(-engine.max_model_len // c.block_size), dtype=torch.int32, device=dev),
            context_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            sample_rows=torch.arange(n, device=dev), max_query_len=1)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            meta = BatchMeta(self.meta.slot_mapping[:size], self.meta.block_tables[:size],
                             self.meta.context_lens[:size], self.meta.query_start_loc[:size + 1],
                             self.meta.sample_rows[:size], 1)
            args = (self.ids[:size], self.pos[:size], meta, engine.kv_cache.layers)
            engine.model(*args)  # warm up: lazy initialisation must not happen during capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = engine.model(*args)
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


class LLM(Engine):
    """Offline use: generate() and chat() run every request to completion, batched continuously."""

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.apply_chat_template(m) for m in conversations], sampling_params)
