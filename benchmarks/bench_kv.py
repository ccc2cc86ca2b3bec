"""Accuracy of the 8-bit and bfloat16 KV caches against the model's own dtype (`auto`), on the same weights:
greedy agreement over 32 chat prompts (tokens in common before the first difference), the mean |delta logprob|
of the tokens both runs chose, and the perplexity of the model over a fixed text (../shared/seed by default).

    python -m benchmarks.bench_kv [--types auto fp8_e4m3 fp8_e5m2 int8 bfloat16] [--text FILE] [engine flags]
"""

from __future__ import annotations

import math
import os
import sys

import torch

from cli import ArgumentParser, add_cli_args, from_cli_args
from engine import LLM, SamplingParams
from kv_cache import KV_CACHE_DTYPES
from runner import StepBatch
from sequence import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
TOPICS = [
    "the ocean",
    "a lighthouse",
    "photosynthesis",
    "the Roman Empire",
    "prime numbers",
    "coffee",
    "volcanoes",
    "the internet",
]
TASKS = [
    "Explain {} to a child.",
    "Write a short poem about {}.",
    "List three facts about {}.",
    "What is the history of {}?",
]
PROMPTS = [[{"role": "user", "content": task.format(topic)}] for topic in TOPICS for task in TASKS]  # 32


def greedy(llm: LLM, max_tokens: int) -> list[list[tuple[int, float]]]:
    """Each chat prompt's greedy tokens with their logprobs, all prompts in one continuous batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [llm.add_request(llm.tokenizer.apply_chat_template(m), params) for m in PROMPTS]
    got: dict[str, list[tuple[int, float]]] = {i: [] for i in ids}
    while llm.has_unfinished():
        for out in llm.step():
            got[out.request_id].append((out.logprob.token_id, out.logprob.logprob))
    return [got[i] for i in ids]


@torch.inference_mode()
def perplexity(llm: LLM, text: str, chunk: int) -> tuple[float, int]:
    """exp(mean negative logprob) of each token of text given those before it, run as one sequence through the
    paged cache in prefill chunks of `chunk` tokens (so later chunks read earlier K/V back from the cache)."""
    ids = llm.tokenizer.encode(text)[: llm.max_model_len]
    seq = Sequence("ppl", ids, SamplingParams())
    llm.block_manager.allocate(seq.block_table, len(ids))
    nll = []
    try:
        while seq.num_computed_tokens < len(ids):
            n = min(chunk, len(ids) - seq.num_computed_tokens)
            batch, *_ = StepBatch.build([(seq, n)], llm.config.block_size)
            batch.logits_indices = list(range(n))  # every position's logits, not only the last
            logits = llm.runner.forward([], [], batch).float().log_softmax(-1)
            begin = seq.num_computed_tokens
            targets = torch.tensor(ids[begin + 1 : begin + n + 1])
            nll += (-logits[: len(targets)].gather(1, targets[:, None])[:, 0]).tolist()
            seq.num_computed_tokens += n
    finally:
        llm.block_manager.free(seq.block_table)
    return math.exp(sum(nll) / len(nll)), len(nll)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="bench_kv.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--types",
        nargs="+",
        default=["auto", *KV_CACHE_DTYPES],
        choices=["auto", *KV_CACHE_DTYPES],
        help="KV cache dtypes to compare; the first is the reference",
    )
    parser.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "seed", "000_40d6dcf6f4393731.txt"))
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk of the perplexity run")
    add_cli_args(parser)  # its --kv-cache-dtype is replaced by each of --types
    args = parser.parse_args(argv)
    try:
        text = open(args.text, encoding="utf-8").read()
    except OSError as e:
        parser.error(f"--text: cannot read {args.text}: {e.strerror}")
    rows, ref = [], None
    for kind in args.types:
        llm = LLM(from_cli_args(args, kv_cache_dtype=kind))
        runs = greedy(llm, args.tokens)
        ppl, n = perplexity(llm, text, args.chunk)
        ref = ref or runs
        common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a[0] != b[0]), len(x)) for x, y in zip(runs, ref)]
        deltas = [abs(a[1] - b[1]) for x, y, c in zip(runs, ref, common) for a, b in zip(x[:c], y[:c])]
        rows.append(
            f"| {kind} | {sum(common) / len(common):.1f} of {args.tokens} | "
            f"{sum(c == args.tokens for c in common)}/{len(common)} | "
            f"{sum(deltas) / len(deltas):.4f} | {ppl:.4f} |"
        )
        del llm
    print(f"model {args.model}, {n + 1} tokens of {os.path.basename(args.text)} in chunks of {args.chunk}")
    print(
        "| KV cache | tokens in common before the first difference (mean) | prompts identical | "
        "mean abs delta logprob | perplexity |\n| --- | --- | --- | --- | --- |"
    )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
