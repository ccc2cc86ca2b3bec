"""A build-time variant of the paged-attention kernel (the -D values at the top of attention_cuda/paged_attention.cu),
built into an extension directory of its own and timed by bench_kernel, so that .ci/gpu compares it with the default
in the same run on the same GPU.
    python .ci/kernel_variant.py build|bench OUT NAME:UNROLL:CODE_LOAD"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
what, out, spec = sys.argv[1:]
name, unroll, load = spec.split(":")
os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", out), f"variant_{name}")
import attention_cuda.kernel  # noqa: E402

attention_cuda.kernel.NVCC_FLAGS += [f"-DLANESERVE_UNROLL={unroll}", f"-DLANESERVE_CODE_LOAD={load}"]
attention_cuda.kernel.kernels()
print(f"variant {name} (UNROLL {unroll}, CODE_LOAD {load}): built", flush=True)
if what == "bench":
    from benchmarks import bench_kernel

    for kv in ("auto", "fp8_e4m3"):
        bench_kernel.main(
            [
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--kv-cache-dtype",
                kv,
                "--batches",
                "64",
                "256",
                "--contexts",
                "4096",
                "--time-limit",
                "8",
                "--json",
                f"{out}/variant_{name}_{kv}.json",
            ]
        )
