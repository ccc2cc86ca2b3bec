import glob
import os

from setuptools import setup

# Every top-level module but the tests: a new file is packaged without a list to keep in step.
MODULES = sorted(
    f[:-3] for f in glob.glob("*.py") if not f.startswith("test_") and f not in ("setup.py", "conftest.py")
)


def cuda_build() -> dict:
    """Build the attention kernel ahead of time only where torch itself is a CUDA build
    (pip install --no-build-isolation -e .); everywhere else it is built on first use, or not at all."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension

        import attention_cuda.kernel
    except ImportError:
        return {}
    ext = attention_cuda.kernel.cuda_extension() if torch.version.cuda else None
    if ext and not torch.cuda.is_available():
        # torch compiles for the GPUs it sees; seeing none (a build host), it has no list and fails. Take the
        # architectures the tests compile for, and PTX that later GPUs compile on load.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtension}} if ext else {}


setup(
    name="laneserve",
    version="0.1.0",
    description="A minimalist LLM inference engine: continuous batching, paged KV, chunked prefill",
    license="MIT",
    python_requires=">=3.10",
    py_modules=MODULES,
    packages=["attention_cuda", "cpu_matmul", "server", "benchmarks"],
    package_data={"attention_cuda": ["*.cu", "*.cpp", "*.h"], "cpu_matmul": ["*.cpp"], "server": ["page.html"]},
    entry_points={"console_scripts": ["laneserve = bench:laneserve"]},  # laneserve serve ..., laneserve bench ...
    install_requires=[
        "torch>=2.5",
        "numpy",
        "tiktoken",
        "ninja",
        "gguf",
        "safetensors",
        "jinja2",
        "tokenizers",
        "llguidance",
    ],
    extras_require={"test": ["pytest", "transformers", "accelerate", "openai", "hypothesis", "selenium", "ruff"]},
    **cuda_build(),
)
