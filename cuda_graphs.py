"""The runner's CUDA-only optimisation, as cpu.py holds its CPU-only ones: decode steps replayed as CUDA graphs."""

from __future__ import annotations

import torch

from model import BatchMeta, Transformer


class DecodeGraphs:
    """CUDA graphs for decode steps, which skip the per-kernel launch cost that dominates small batches: one per
    batch size of a ladder, a step of n sequences replaying the smallest with room for n, padded with sequences
    that read nothing (context 0) and write nothing (slot -1). Every tensor a graph reads is a static buffer below."""

    def __init__(
        self,
        model: Transformer,
        kv_layers: list,
        dev: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ):
        self.sizes = [s for s in (1, 2, 4, 8, *range(16, 513, 16)) if s < max_num_seqs] + [max_num_seqs]
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.meta = BatchMeta(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.zeros(n, -(-max_model_len // block_size), dtype=torch.int32, device=dev),
            context_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(n, device=dev),
            max_query_len=1,
            max_context_len=max_model_len,
            query_lens=[1] * n,
            host_context_lens=[],
            prompt_lens=[],
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        # Captured on a stream of our own device: torch.cuda.graph's default stream is made once per process, on
        # the device current then, and a capture there would miss this device's work (engines on two GPUs).
        stream = torch.cuda.Stream(dev)
        m = self.meta
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            meta = BatchMeta(
                m.slot_mapping[:size],
                m.block_tables[:size],
                m.context_lens[:size],
                m.logits_indices[:size],
                1,
                m.max_context_len,
                [1] * size,
                [],
                [],
            )
            args = (self.ids[:size], self.pos[:size], meta, kv_layers)
            model(*args)  # warm up: lazy initialisation must not happen during capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = model(*args)
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
