"""The model runner: the model and its KV cache on a device. One step: the batch built on the host (StepBatch.build),
broadcast to the other tensor-parallel ranks, the swaps, the batch moved to the device (to_device), the forward pass
and sampling (sampler.py)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

import cpu
import parallel
import structured
import weights
from config import EngineConfig
from cuda_graphs import DecodeGraphs
from kv_cache import KV_CACHE_DTYPES, KVCache, KVShape, slots
from model import BatchMeta, ModelConfig, Transformer
from sampler import Sampled, sample, to_device
from sequence import SamplingParams, Sequence, require


@dataclass
class StepBatch:
    """One step's tokens as host lists, sequence after sequence (one-token pieces first): what rank 0 broadcasts
    to the other ranks and every rank moves to its device."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded with 0 to the longest
    context_lens: list[int]
    logits_indices: list[int]  # the sampled rows, then the rows scoring prompt tokens
    query_lens: list[int]
    prompt_lens: list[int]

    @classmethod
    def build(
        cls, scheduled: list[tuple[Sequence, int]], block_size: int
    ) -> tuple[StepBatch, list[Sequence], list[tuple[Sequence, list[int]]]]:
        """The batch, the sequences sampled this step (those whose piece reaches their last token), and those
        scoring prompt tokens (prompt_logprobs) with the tokens their rows score."""
        scheduled = sorted(scheduled, key=lambda item: item[1] > 1)
        input_ids, positions, slot_mapping, block_tables, context_lens = [], [], [], [], []
        logits_indices, sampled, score_rows, scored = [], [], [], []
        for seq, n in scheduled:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if seq.params.prompt_logprobs is not None:  # position p's row scores token p + 1; recomputed ones are not
                score = range(max(begin, len(seq.prompt_logprobs)), min(end, seq.num_prompt_tokens - 1))
                score_rows += [len(input_ids) + p - begin for p in score]
                scored += [(seq, seq.token_ids[score.start + 1 : score.stop + 1])] if score else []
            input_ids += seq.token_ids[begin:end] + seq.draft
            positions += range(begin, end)
            slot_mapping += slots(seq.block_table, block_size, begin, end)
            block_tables.append(seq.block_table)
            context_lens.append(end)
            if end == seq.num_tokens + len(seq.draft):  # its last token's row, then its drafts'
                logits_indices += range(len(input_ids) - 1 - len(seq.draft), len(input_ids))
                sampled.append(seq)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return (
            cls(
                input_ids,
                positions,
                slot_mapping,
                tables,
                context_lens,
                logits_indices + score_rows,
                [n for _, n in scheduled],
                [seq.num_prompt_tokens for seq, _ in scheduled],
            ),
            sampled,
            scored,
        )

    def to_device(self, dev: torch.device, sampling: bool = True) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        """Input ids, positions and metadata on the device."""
        i32, i64 = torch.int32, torch.int64
        rows = self.logits_indices if sampling else []  # only rank 0 samples: no LM head runs on the others
        meta = BatchMeta(
            to_device(self.slot_mapping, i64, dev),
            to_device(self.block_tables, i32, dev),
            to_device(self.context_lens, i32, dev),
            to_device(rows, i64, dev),
            max(self.query_lens),
            max(self.context_lens),
            self.query_lens,
            self.context_lens,
            self.prompt_lens,
        )
        return to_device(self.input_ids, i64, dev), to_device(self.positions, i64, dev), meta


class ModelRunner:
    """The model on its device. With tensor_parallel_size > 1 this is one rank's shard: rank 0 (the engine's
    runner) spawns the others, which run `run_worker`; `rank` and `address` are theirs."""

    def __init__(
        self, config: EngineConfig, rank: int = 0, address: str | None = None, model_config: ModelConfig | None = None
    ):
        self.config = c = config
        device = torch.device(c.device if c.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
        require(
            [
                (not c.quantization or device.type == "cpu", "--quantization int4 runs on CPU only"),
                (
                    device.type != "cuda" or (device.index or 0) < torch.cuda.device_count(),
                    f"device {c.device}: torch sees {torch.cuda.device_count()} CUDA devices here",
                ),
            ]
        )
        self.tp = (
            parallel.TensorParallel(c.tensor_parallel_size, device.type, c.torch_threads, rank, address)
            if c.tensor_parallel_size > 1 or parallel.launched_by_torchrun()
            else None
        )
        self.rank, tp_size = (self.tp.rank, self.tp.size) if self.tp else (0, 1)
        self.device = self.tp.device if self.tp else device
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
        c, on_cpu = self.config, self.device.type == "cpu"
        self.checkpoint_path = None if c.dummy_weights else weights.resolve_checkpoint(c.model, c.model_path)
        # Unset on a CPU: a Q4_1 GGUF's own 4-bit blocks where the kernels run (cpu.own_format).
        self.quantization = c.quantization or (
            cpu.own_format(self.checkpoint_path) if on_cpu and c.dtype == "auto" else None
        )
        # auto: float32 beside 4-bit weights, as llama.cpp (the int4 kernel makes 8-bit codes of its input either
        # way: bfloat16 would round the residual stream to save little), else bfloat16 where it is fast (CUDA, bf16
        # units).
        wide = on_cpu and (self.quantization or not cpu.has_bf16_units())
        self.dtype = (torch.float32 if wide else torch.bfloat16) if c.dtype == "auto" else getattr(torch, c.dtype)
        self.kv_dtype = KV_CACHE_DTYPES.get(c.kv_cache_dtype, self.dtype)
        if c.dummy_weights:
            self.model_config = model_config or weights.preset(c.model)
            state = weights.dummy_weights(self.model_config, self.dtype, c.seed, self.device, self.rank, tp_size)
        else:
            if self.rank == 0:
                print(f"loading {self.checkpoint_path}", file=sys.stderr)
            self.model_config, state = weights.load_weights(self.checkpoint_path, self.dtype, self.rank, tp_size)
        mc = self.model_config
        self.max_model_len = c.max_model_len or mc.max_position_embeddings
        require(
            [
                (
                    self.max_model_len <= mc.max_position_embeddings,
                    f"max_model_len {self.max_model_len} exceeds the "
                    f"model's context length {mc.max_position_embeddings}",
                ),
                (
                    on_cpu or self.kv_dtype.itemsize == 1 or self.kv_dtype == self.dtype,
                    f"--kv-cache-dtype bfloat16 beside --dtype {c.dtype} runs on a CPU only",
                ),
                (
                    self.device.type != "cuda" or mc.head_dim in (64, 128, 256 if self.kv_dtype.itemsize < 4 else 128),
                    f"the CUDA kernel takes head_dim 64 or 128, or 256 with a 16- or 8-bit KV cache: not {mc.head_dim}",
                ),
            ]
        )
        self.model = Transformer(mc, self.max_model_len, self.device, tp_size)
        weights.load_state_dict(self.model, state)
        if on_cpu:
            cpu.optimize(self.model, self.quantization, c.max_num_seqs)

    def _allocate_kv(self) -> None:
        """The KV pool: a fixed size, or what the memory knobs leave once the weights are in."""
        c, mc = self.config, self.model_config
        kv = KVShape(mc.num_hidden_layers, self.model.layers[0].kv_heads, mc.head_dim)
        per_block = kv.bytes_per_block(c.block_size, self.kv_dtype)
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
            raise ValueError(
                f"no memory left for the KV cache (one block is {per_block} bytes): raise "
                "--kv-cache-memory or --gpu-memory-utilization, or set --num-kv-blocks"
            )
        self.num_swap_blocks = int(c.swap_space * 2**30) // per_block if c.preemption_mode == "swap" else 0
        try:
            if self.device.type == "cpu":  # the pool is zeroed at once, the swap blocks filled later: both must fit
                cpu.check_free_memory((self.num_kv_blocks + self.num_swap_blocks) * per_block)
            self.kv_cache = KVCache(
                kv, self.num_kv_blocks, c.block_size, self.kv_dtype, self.device, self.num_swap_blocks
            )
        except (RuntimeError, MemoryError) as e:  # the allocator's message names no knob
            raise ValueError(
                f"cannot allocate {self.num_kv_blocks} KV blocks and {self.num_swap_blocks} swap blocks "
                f"of {per_block} bytes (--num-kv-blocks, --kv-cache-memory, --swap-space): "
                f"{str(e).splitlines()[0][:200]}"
            ) from None
        self.graphs = None
        if self.device.type == "cuda" and not c.enforce_eager:
            args = (self.kv_cache.layers, self.device, c.max_num_seqs, self.max_model_len, c.block_size)
            self.graphs = DecodeGraphs(self.model, *args)
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
            # Asking for prompt logprobs: every row of the chunk has logits.
            s = Sequence(
                "profile", ids, SamplingParams(prompt_logprobs=0), block_table=table, num_computed_tokens=length - n
            )
            return s, n

        chunks = sorted({min(c.max_num_batched_tokens, n) for n in (length, length - 1)}, reverse=True)
        return [[seq(n)] for n in chunks] + [[seq(1) for _ in range(c.max_num_seqs)]]

    def _profile_peak_memory(self, kv: KVShape) -> int:
        """GPU bytes the worst step allocates beyond those in use before (weights): what the KV pool must leave free."""
        dev = self.device
        scratch = KVCache(kv, 1, self.config.block_size, self.kv_dtype, dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        for step in self._profile_steps():
            batch, *rows = StepBatch.build(step, self.config.block_size)
            logits = self.model(*batch.to_device(dev, self.rank == 0), scratch.layers)
            if self.rank == 0:  # the only rank that samples
                sample(logits, *rows)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del scratch
        torch.cuda.empty_cache()
        return peak

    def run(
        self,
        scheduled: list[tuple[Sequence, int]],
        swap_out: list[tuple[int, int]] = (),
        swap_in: list[tuple[int, int]] = (),
    ) -> list[Sampled]:
        """One step: build the batch, broadcast it to the other ranks, forward it, sample: each sampled sequence's
        next token, and the token after each of its drafts, and the prompt tokens' logprobs this step scored. Failing
        is fatal under tensor parallelism (WorkerFailure)."""
        batch, sampled, scored = StepBatch.build(scheduled, self.config.block_size) if scheduled else (None, [], [])
        masks = structured.masks(sampled, self.model_config.vocab_size, self.device.type == "cuda")
        try:
            if self.tp:
                self.tp.broadcast((swap_out, swap_in, batch))
            logits = self.forward(swap_out, swap_in, batch)
        except Exception as e:
            if self.tp:
                raise self.tp.fail(e) from e
            raise
        return sample(logits, sampled, scored, masks) if batch else []

    def forward(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], batch: StepBatch | None
    ) -> torch.Tensor | None:
        """Every rank's part of a step: the swaps, then the batch to the device and through the model, writing the
        scheduled sequences' new K/V; the sampled rows' logits (none off rank 0)."""
        self.kv_cache.swap(swap_out, swap_in)
        if batch is None:
            return None
        ids, pos, meta = batch.to_device(self.device, self.rank == 0)
        if self.graphs and meta.max_query_len == 1:  # the largest graph holds max_num_seqs rows
            # A graph computes every row; a one-token prefill piece that is not its prompt's end samples none.
            return self.graphs.run(ids, pos, meta)[meta.logits_indices]
        return self.model(ids, pos, meta, self.kv_cache.layers)


def run_worker(
    config: EngineConfig, model_config: ModelConfig | None = None, rank: int = 0, address: str | None = None
) -> None:
    """A tensor-parallel rank other than 0: load its part, then run each step rank 0 broadcasts until it says stop
    (None) or goes away. A failure ends the worker with one line (rank 0 tells its users), or none if rank 0 is gone."""
    try:
        runner = ModelRunner(config, rank, address, model_config)
        weights.read_gguf.cache_clear()  # the parsed header (vocabulary included) is the tokenizer's, on rank 0
        try:
            while (step := runner.tp.broadcast(None)) is not None:
                runner.forward(*step)
        finally:
            runner.tp.close()
    except Exception as e:
        if parallel.rank_0_gone():
            os._exit(1)
        sys.exit(f"laneserve: tensor-parallel worker: {type(e).__name__}: {e}")


def kv_cache_bytes(total: int, free: int, peak: int, utilization: float) -> int:
    """The KV pool's bytes: gpu_memory_utilization of total, less what is in use (weights, other processes) and peak."""
    return int(total * utilization) - (total - free) - peak
