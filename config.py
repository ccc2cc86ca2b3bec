"""The engine's knobs, declared once: EngineConfig's fields are the Python API, and serve.py and bench.py
build their command lines from them (help text included), so a new knob appears everywhere at once."""

import math
import os
import re
from dataclasses import dataclass, field, fields

from sequence import require, typed

DEFAULT_MODEL = "smollm2-135m"


def knob(default, help: str, **cli):
    """A field with its command-line help; cli may add `type` (for a None default) and `choices`."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class EngineConfig:
    model: str = knob(DEFAULT_MODEL, "preset (see weights.PRESETS), HF repo id or checkpoint path")
    model_path: str | None = knob(None, "checkpoint for --model: a .gguf file or a Hugging Face directory", type=str)
    dummy_weights: bool = knob(False, "random weights in the preset's shapes (for benchmarking)")
    device: str = knob("auto", "cpu, cuda or cuda:N; auto: CUDA when available")
    dtype: str = knob(
        "auto",
        "weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with bf16 dot products, else float32; float32 too "
        "beside 4-bit weights (on a CPU, a Q4_1 GGUF's matmuls run in its own blocks: --quantization int4, as "
        "llama.cpp); float32: transformers' numbers",
        choices=["auto", "float32", "float16", "bfloat16"],
    )
    kv_cache_dtype: str = knob(
        "auto",
        "KV cache in 8 bits, a float32 scale per token and KV head (about twice bfloat16's tokens in the same "
        "memory); bfloat16 beside --dtype float32 (a CPU's default beside 4-bit weights) halves its bytes, as "
        "llama.cpp's 16-bit cache; auto: --dtype",
        choices=["auto", "fp8_e4m3", "fp8_e5m2", "int8", "bfloat16"],
    )
    quantization: str | None = knob(
        None,
        "CPU: 4-bit matmul weights (a GGUF's own Q4 blocks) by 8-bit dot products, as llama.cpp: a quarter of "
        "bfloat16's weight bytes; its speed is in benchmarks/README.md. Unset: the default for a Q4_1 GGUF with "
        "--dtype auto wherever the CPU kernels run",
        type=str,
        choices=["int4"],
    )
    seed: int = knob(0, "seeds the requests that bring none")
    max_model_len: int | None = knob(None, "context length, prompt plus output (default: the model's)", type=int)
    max_num_seqs: int = knob(64, "most sequences in one batch")
    max_num_batched_tokens: int = knob(512, "tokens one step may compute: prefill chunks plus decodes")
    enable_chunked_prefill: bool = knob(True, "split long prompts across steps so running sequences keep decoding")
    scheduling: str = knob(
        "continuous",
        "continuous (iteration-level) batching, or static (request-level) for comparison",
        choices=["continuous", "static"],
    )
    preemption_mode: str = knob(
        "recompute",
        "when KV runs out, the newest sequence drops its KV to recompute it later, or swaps it to host memory",
        choices=["recompute", "swap"],
    )
    swap_space: float = knob(4.0, "GiB of host memory for swapped-out KV")
    enable_prefix_caching: bool = knob(False, "share the KV of identical prompt prefixes")
    prefix_cache_isolation: bool = knob(
        False,
        "with prefix caching, a request without cache_salt gets a salt of its "
        "own: only requests sending the same cache_salt share blocks",
    )
    block_size: int = knob(16, "tokens per KV block")
    num_kv_blocks: int | None = knob(None, "exact KV pool size in blocks, overriding the memory knobs", type=int)
    kv_cache_memory: float = knob(2.0, "GiB of KV pool on CPU")
    gpu_memory_utilization: float = knob(0.9, "share of GPU memory to use; the KV pool gets what the model leaves")
    enforce_eager: bool = knob(False, "CUDA: run decode steps eagerly, without CUDA graphs")
    chat_template: str | None = knob(None, "a Jinja chat template file to use instead of the checkpoint's", type=str)
    generation_config: str = knob(
        "auto",
        "auto: a Hugging Face checkpoint's generation_config.json (else a "
        "preset's model card) sets the defaults of sampling fields requests "
        "leave out; vllm: neither does",
        choices=["auto", "vllm"],
    )
    torch_threads: int | None = knob(
        None,
        "torch intra-op threads (default: torch's, one per core; with tensor "
        "parallelism on CPU, the cores shared among the ranks)",
        type=int,
    )
    tensor_parallel_size: int = knob(
        1,
        "split the model across this many GPUs (NCCL) or CPU processes (gloo), "
        "Megatron-style; under torchrun, the processes it starts",
    )
    num_speculative_tokens: int = knob(
        0,
        "n-gram (prompt lookup) speculative decoding, output bit for bit "
        "unchanged: most draft tokens per sequence and step; 0: off",
    )
    prompt_lookup_max: int = knob(4, "speculation: longest n-gram of a sequence's last tokens looked up in it")
    prompt_lookup_min: int = knob(2, "speculation: shortest such n-gram")

    def __post_init__(self):
        """Refuse impossible settings at once, with a message naming the knob."""
        require(
            [
                typed(f.name, getattr(self, f.name), f.metadata.get("type", type(f.default)), f.default is None)
                for f in fields(self)
                if "help" in f.metadata
            ]
        )
        cores = os.cpu_count() or 1
        require(
            [
                (
                    self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                    f"block_size must be a power of two, got {self.block_size}",
                ),
                (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
                (
                    self.max_num_batched_tokens >= self.block_size,
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least one block "
                    f"({self.block_size} tokens)",
                ),
                (
                    self.max_model_len is None or self.max_model_len >= 2,
                    "max_model_len must be >= 2 (a prompt token and a generated one)",
                ),
                (not (self.dummy_weights and self.model_path), "dummy_weights loads no checkpoint: drop model_path"),
                (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1"),
                (0 < self.kv_cache_memory < math.inf, "kv_cache_memory must be > 0 and finite"),
                (0 <= self.swap_space < math.inf, "swap_space must be >= 0 and finite"),
                (0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]"),
                (
                    self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", self.device) is not None,
                    f"unknown device {self.device!r} (auto, cpu, cuda or cuda:N)",
                ),
                (self.seed >= 0, "seed must be >= 0"),
                (
                    self.num_speculative_tokens >= 0 and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                    "num_speculative_tokens must be >= 0 and 1 <= prompt_lookup_min <= prompt_lookup_max",
                ),
                (
                    self.torch_threads is None or 1 <= self.torch_threads <= cores,
                    f"torch_threads must be in [1, {cores}] (this machine's cores)",
                ),
                (self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
                (
                    self.tensor_parallel_size == 1 or not self.device.startswith("cuda:"),
                    "--device cuda:N names one GPU; "
                    "tensor parallelism uses cuda:0 to cuda:N-1 (choose them with CUDA_VISIBLE_DEVICES)",
                ),
                (
                    self.chat_template is None or os.path.isfile(self.chat_template),
                    f"chat_template: no file {self.chat_template}",
                ),
                *(
                    (
                        getattr(self, f.name) in (None, *f.metadata["choices"]),
                        f"{f.name} must be one of {', '.join(f.metadata['choices'])}, got {getattr(self, f.name)!r}",
                    )
                    for f in fields(self)
                    if "choices" in f.metadata
                ),
            ]
        )
