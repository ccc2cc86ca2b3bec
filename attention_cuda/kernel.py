"""The CUDA kernel's Python side: its build (on first use with ninja, or ahead of time by setup.py) and its two
launchers, each taking the same arguments as its reference in attention_cuda/__init__.py."""

import glob
import os

import torch

SOURCES = ["binding.cpp", "paged_attention.cu"]
CXX_FLAGS = ["-O3"]  # torch adds the C++ standard it needs (C++20 for torch 2.13)
NVCC_FLAGS = ["-O3", "-lineinfo"]
_ext = None


def kernels():
    """The compiled kernels, as torch.ops.laneserve: setup.py's prebuilt library if there is one, else built on
    first use with ninja into torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) for
    the GPUs present (or TORCH_CUDA_ARCH_LIST), and reused until the sources or flags change."""
    global _ext
    if _ext is None:
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            built = glob.glob(os.path.join(here, "_C*.so"))
            if built:
                torch.ops.load_library(built[0])
            else:
                from torch.utils.cpp_extension import load

                load(
                    "laneserve_attention",
                    [os.path.join(here, s) for s in SOURCES],
                    extra_cflags=CXX_FLAGS,
                    extra_cuda_cflags=NVCC_FLAGS,
                    is_python_module=False,
                )
            _ext = torch.ops.laneserve
        except Exception as e:
            _ext = RuntimeError(  # kept, so that later calls fail at once with the same message
                f"could not build the CUDA paged-attention kernel ({type(e).__name__}: {e}). Building "
                "needs a CUDA build of torch, the CUDA toolkit (nvcc; CUDA_HOME if not on PATH) of a "
                "matching version, a C++ compiler and ninja. The pure-PyTorch path needs none of "
                "that and still works: attention_cuda.paged_attention/store_kv, and running on CPU."
            )
            _ext.__cause__ = e
    if isinstance(_ext, Exception):
        raise _ext
    return _ext


def cuda_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """paged_attention on CUDA tensors, by the kernel: same arguments, same result (a new contiguous tensor). head_dim
    64 or 128 (256 in 16 or 8 bits), block_size 8, 16 or 32, float32/float16/bfloat16, block_tables and context_lens
    int32 on the same GPU; errors otherwise. Runs on the current stream. max_context_len: the longest context_lens entry
    or more, from the host (so no device sync); it bounds the fp32 scratch. None: all that block_tables addresses. Each
    sequence's result depends on its own context alone. An 8-bit cache (float8_e4m3fn, float8_e5m2, int8) needs its
    k_scale and v_scale; the kernel dequantizes as it loads."""
    if max_context_len is None:  # 0 for shapes the binding rejects, so that its message is the one raised
        shaped = block_tables.dim() == 2 and k_cache.dim() == 4
        max_context_len = block_tables.shape[1] * k_cache.shape[1] if shaped else 0
    with torch.cuda.device(query.device if query.is_cuda else -1):
        return kernels().paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            float(scale),
            int(max_context_len),
            k_scale,
            v_scale,
            int(window),
            torch.cuda.current_stream().cuda_stream,
        )


def cuda_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """store_kv on CUDA tensors, by the kernel (slot_mapping int64, -1 skipped). Current stream. With scales (an
    8-bit cache), quantized: codes and scales bit for bit quantize_kv's."""
    with torch.cuda.device(key.device if key.is_cuda else -1):
        kernels().store_kv(
            key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, torch.cuda.current_stream().cuda_stream
        )


def cuda_extension():
    """For setup.py: the kernels as a CUDAExtension `attention_cuda._C` (paths relative to the
    repository root), which kernels() then loads instead of building; None without nvcc."""
    from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension

    if CUDA_HOME is None:
        return None
    return CUDAExtension(
        "attention_cuda._C",
        [os.path.join("attention_cuda", s) for s in SOURCES],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
    )
