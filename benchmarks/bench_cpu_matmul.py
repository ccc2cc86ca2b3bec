"""The CPU matmul kernel (cpu_matmul) against oneDNN (cpu.PackedLinear; float32/bfloat16) and torch's int4 kernel
(cpu.Int4Linear) on SmolLM2-135M's linear layers, at a few row counts: milliseconds per pass over all the
layer shapes of one decoder block plus a 30th of the LM head, the fastest of a few passes.
Usage: python -m benchmarks.bench_cpu_matmul [--rows 1 64 512]"""

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
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
