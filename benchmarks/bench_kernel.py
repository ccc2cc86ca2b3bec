"""Decode attention alone, on Llama-3-8B shapes: our CUDA kernel (on a GPU) or cpu.py's decode (on a CPU) beside
the pure-PyTorch reference. Bandwidth counts the bytes that must be read (every sequence's K and V, their scales in
an 8-bit cache, and Q): decode attention is memory-bound."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import attention_cuda
import attention_cuda.kernel
import cpu
from kv_cache import KV_CACHE_DTYPES


def timed(fn, cuda: bool) -> tuple[torch.Tensor, float]:
    """fn's result and its time in ms, over about 0.2 s of repeats after a warm-up call."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = fn()  # on CUDA the first call may also build the kernel
    sync()
    t = time.perf_counter()
    fn()
    sync()
    n = int(min(1000, max(3, 0.2 / max(time.perf_counter() - t, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return out, (time.perf_counter() - t) / n * 1000


def device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")


def copy_bandwidth(args: argparse.Namespace) -> float:
    """GB/s of a plain 1 GiB device-to-device copy, counting its reads and writes."""
    dev = device(args)
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    _, ms = timed(lambda: dst.copy_(src), dev.type == "cuda")
    return 2 * src.numel() / ms / 1e6


def run(args: argparse.Namespace) -> list[dict]:
    dev = device(args)
    cuda = dev.type == "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim, block = 32, 8, 128, 16
    batches = args.batches or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 4, 16])
    contexts = args.contexts or ([512, 1024, 2048, 4096, 8192] if cuda else [512, 1024])
    ours = attention_cuda.kernel.cuda_paged_attention if cuda else cpu.BucketedAttention().decode
    deadline, rows = time.perf_counter() + args.time_limit, []
    if cuda:
        print("bench_kernel.py: loading the CUDA kernel (built on first use: can take minutes) ...", file=sys.stderr)
    for ctx in contexts:
        for bs in batches:
            if time.perf_counter() > deadline:
                return rows
            nblk = -(-ctx // block)
            try:
                k, v = (torch.randn(bs * nblk, block, kv_heads, dim, device=dev, dtype=dtype) for _ in range(2))
                scales = {}
                if args.kv_cache_dtype != "auto":  # codes and a scale per token and KV head, as store_kv leaves them
                    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
                    (k, k_scale), (v, v_scale) = (attention_cuda.quantize_kv(x.flatten(0, 1), kv_dtype) for x in (k, v))
                    k, v = k.view(-1, block, kv_heads, dim), v.view(-1, block, kv_heads, dim)
                    scales = dict(k_scale=k_scale.view(-1, block, kv_heads), v_scale=v_scale.view(-1, block, kv_heads))
                q = torch.randn(bs, heads, dim, device=dev, dtype=dtype)
                # Scattered, as in a pool.
                tables = torch.randperm(bs * nblk, device=dev).view(bs, nblk).to(torch.int32)
                lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
            except RuntimeError:  # the allocator's (CUDA's OutOfMemoryError is one); the sizes say more than its text
                kv_gb = 2 * bs * nblk * block * kv_heads * dim * dtype.itemsize / 1e9
                raise SystemExit(
                    f"bench_kernel.py: error: batch {bs} at context {ctx} does not fit in {dev.type} "
                    f"memory (K and V alone take {kv_gb:.3g} GB): lower --batches or --contexts"
                ) from None
            row_bytes = dim * k.element_size() + 4 * bool(scales)  # a token's K (or V) of one KV head, its scale
            nbytes = 2 * bs * ctx * kv_heads * row_bytes + q.numel() * q.element_size()
            row = {"batch": bs, "context": ctx, "bytes": nbytes}
            try:
                out, row["ours_ms"] = timed(lambda: ours(q, k, v, tables, lens, dim**-0.5, **scales), cuda)  # noqa: B023 (called at once)
            except RuntimeError as e:  # the kernel's build failed: its message says what is missing
                raise SystemExit(f"bench_kernel.py: error: {e}") from None
            ref, row["reference_ms"] = timed(
                lambda: attention_cuda.paged_attention(q, k, v, tables, lens, dim**-0.5, **scales),  # noqa: B023 (called at once)
                cuda,
            )
            row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench import _number
    from cli import ArgumentParser

    p = ArgumentParser(prog="bench_kernel.py", description=__doc__)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *(k for k in KV_CACHE_DTYPES if k != "bfloat16")],
        help="the cache read in 8 bits (codes and scales, dequantized by the kernel); auto: --dtype",
    )
    p.add_argument(
        "--batches", type=_number(int), nargs="+", help="batch sizes (default 1..256 on CUDA, 1 4 16 on CPU)"
    )
    p.add_argument("--contexts", type=_number(int), nargs="+", help="context lengths (default 512..8192 on CUDA)")
    p.add_argument("--time-limit", type=_number(float), default=300, help="seconds; the rows measured by then are kept")
    p.add_argument("--json", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    try:
        dev = device(args)
    except RuntimeError as e:
        p.error(f"--device {args.device}: {e}")
    if dev.type not in ("cpu", "cuda") or dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {args.device}: not a device here (CUDA devices: {torch.cuda.device_count()})")
    if args.json and (os.path.isdir(args.json) or not os.access(os.path.dirname(os.path.abspath(args.json)), os.W_OK)):
        p.error(f"--json: cannot write {args.json}")
    rows = run(args)
    print(
        f"{'context':>8}{'batch':>7}{'KV+Q MB':>10}{'ours ms':>10}{'GB/s':>9}{'ref ms':>10}{'GB/s':>9}"
        f"{'speedup':>9}{'max|diff|':>11}"
    )
    for r in rows:
        mb = r["bytes"] / 1e6
        print(
            f"{r['context']:>8}{r['batch']:>7}{mb:>10.1f}{r['ours_ms']:>10.3f}{mb / r['ours_ms']:>9.1f}"
            f"{r['reference_ms']:>10.3f}{mb / r['reference_ms']:>9.1f}{r['reference_ms'] / r['ours_ms']:>9.1f}"
            f"{r['max_abs_diff']:>11.2e}"
        )
    copy = copy_bandwidth(args)
    print(f"device memory copy: {copy:.1f} GB/s (bytes read + written), the bandwidth the kernel can approach")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
