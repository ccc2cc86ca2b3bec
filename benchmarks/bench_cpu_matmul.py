"""The CPU matmul kernel (cpu_matmul) against oneDNN (cpu.PackedLinear; float32/bfloat16) and torch's int4 kernel
(cpu.Int4Linear) on SmolLM2-135M's linear layers, at a few row counts: milliseconds per pass over all the
layer shapes of one decoder block plus a 30th of the LM head, the fastest of a few passes. With --variants, the
kernel alone in each variant named: a whole model's matmuls (30 blocks and the LM head, weights cache-hot) in
bfloat16 against int4 (its LM head int8, as a Q4_1 GGUF keeps it).
Usage: python -m benchmarks.bench_cpu_matmul [--rows 1 64 512] [--variants avx2 avx512_bf16 ...]"""

import argparse
import time

import torch

import cpu
import cpu_matmul

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [n, k]
HEAD = (49152, 576)


def timed(layers: list, x: dict, repeat: int) -> float:
    """The fastest of `repeat` passes, in ms: on a shared machine the others measure the neighbours."""
    best = float("inf")
    for _ in range(repeat + 1):
        t = time.perf_counter()
        for lin, k in layers:
            lin(x[k])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def variants(names: list[str], rows: list[int], repeat: int) -> None:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).bfloat16() / k**0.5 for n, k in SHAPES]
    head = torch.randn(*HEAD, generator=g).bfloat16()
    for name in names:
        isa, cells = cpu_matmul.ISAS[name], []
        for m in rows:
            x = {k: torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536)}
            ms = []
            for quant, head_quant in ((None, None), ("int4", "int8")):
                layers = [(cpu_matmul.Linear(w, isa, quant), w.shape[1]) for w in weights]
                lm_head = [(cpu_matmul.Linear(head, isa, head_quant), 576)]
                ms.append(30 * timed(layers, x, repeat) + timed(lm_head, x, max(2, repeat // 4)))
            cells.append(f"{m} rows {ms[0]:.1f} / {ms[1]:.1f} ({ms[0] / ms[1]:.2f}x)")
        print(f"{name:12} bfloat16 / int4 ms: " + " | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--variants", nargs="+", choices=list(cpu_matmul.ISAS), help="time these kernel variants alone")
    a = p.parse_args()
    if a.variants:
        return variants(a.variants, a.rows, a.repeat)
    isa = cpu_matmul.isa()
    g = torch.Generator().manual_seed(0)
    for dtype, int4 in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        weights = [torch.randn(n, k, generator=g).to(dtype) / k**0.5 for n, k in SHAPES]
        head = torch.randn(*HEAD, generator=g).to(dtype)
        for rows in a.rows:
            x = {k: torch.randn(rows, k, generator=g).to(dtype) for k in (576, 1536)}
            ours = [(cpu_matmul.Linear(w, isa, "int4" if int4 else None), w.shape[1]) for w in weights]
            theirs = [(cpu.Int4Linear(w) if int4 else cpu.PackedLinear(w, rows), w.shape[1]) for w in weights]
            head_ours, head_theirs = cpu_matmul.Linear(head, isa), cpu.PackedLinear(head, rows)
            r = max(2, a.repeat // max(1, rows // 64))
            t_ours = timed(ours, x, r) + timed([(head_ours, 576)], x, r) / 30
            t_theirs = timed(theirs, x, r) + timed([(head_theirs, 576)], x, r) / 30
            name = "int4" if int4 else str(dtype).removeprefix("torch.")
            print(
                f"{name:9} rows {rows:4}: kernel {t_ours:7.3f} ms, {'torch int4' if int4 else 'oneDNN'} "
                f"{t_theirs:7.3f} ms ({t_theirs / t_ours:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
