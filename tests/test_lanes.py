"""Lanes never mix: every request's tokens and logprobs, bit for bit, are those of its lone run, whatever
runs beside it, however its prompt is cut, whether its prefix came from the cache, and whether it was
preempted on the way (recomputed or swapped), with the KV cache in the model's dtype or in 8 bits. On
random weights in SmolLM2's shapes (so the matmul and attention kernels are the real model's), 2 layers
and a vocabulary of 8192: the rule is about how each sequence's arithmetic is arranged, not about the
weights' values, and logprobs compared bit for bit show any difference at once."""

import random
from collections import defaultdict

import pytest

import cpu
import cpu_matmul
import weights
from conftest import traced
from engine import LLM, SamplingParams
from model import ModelConfig

pytestmark = pytest.mark.slow  # the whole file: run by `pytest -q`, not by `-m "not slow"`

MODES = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int4": dict(quantization="int4"),  # the default beside 4-bit weights: float32
    "int4 bfloat16": dict(dtype="bfloat16", quantization="int4"),
}
# (mode, --kv-cache-dtype): each 8-bit KV type in bfloat16, where the scores round most; a bfloat16 cache beside
# int4's float32
KV_MODES = [
    ("float32", "auto"),
    ("bfloat16", "auto"),
    ("bfloat16", "int8"),
    ("bfloat16", "fp8_e4m3"),
    ("bfloat16", "fp8_e5m2"),
    ("int4", "bfloat16"),
]


# Qwen3's and Gemma 3's arithmetic in small shapes: q/k norms; Gemma's norms after attention and MLP, GeGLU, and
# two local layers to a global one over a window of 32 keys, which the 400-token prompts and the 40-260-token
# shared prefixes slide past.
FAMILIES = {
    "qwen3-shapes": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    "gemma3-shapes": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
        gemma=True,
        query_pre_attn_scalar=64,
        sliding_window=32,
        sliding_window_pattern=3,
    ),
}
# Each family in float32, and in bfloat16 with an 8-bit cache (SmolLM2's shapes take every mode).
FAMILY_MODES = [(family, mode, kv) for family in FAMILIES for mode, kv in (("float32", "auto"), ("bfloat16", "int8"))]


@pytest.fixture(scope="module")
def families(smollm2_shapes):
    with pytest.MonkeyPatch.context() as patch:
        for name, config in FAMILIES.items():
            patch.setitem(weights.PRESETS, name, config)
        yield


def engine(model: str, mode: str, **knobs) -> LLM:
    return LLM(model=model, dummy_weights=True, device="cpu", **MODES[mode], **{"num_kv_blocks": 1024, **knobs})


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request's (token, logprob, top logprobs) per step."""
    for i, (ids, params) in enumerate(requests):
        llm.add_request(ids, params, str(i))
    got = defaultdict(list)
    while llm.has_unfinished():
        for out in llm.step():
            got[out.request_id].append((out.token_ids[-1], out.logprob.logprob, out.logprob.top))
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    return got


def alone(llm: LLM, requests) -> dict[str, list]:
    return {str(i): run(llm, [request])["0"] for i, request in enumerate(requests)}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 8192) for _ in range(n)]


@pytest.mark.parametrize("model, mode, kv_cache_dtype", [("smollm2-shapes", *m) for m in KV_MODES] + FAMILY_MODES)
def test_64_lanes_sampling_together(families, model, mode, kv_cache_dtype):
    # 62 short prompts (3-60 tokens) that decode 10-16 tokens, and 2 of 400 tokens arriving last, whose
    # prefill runs beside 62 decodes; a budget of 256 cuts prompts wherever it runs out.
    rng = random.Random(64)
    requests = [(random_prompt(rng, rng.randint(3, 60)), greedy(rng.randint(10, 16))) for _ in range(62)]
    requests += [(random_prompt(rng, 400), greedy(rng.randint(2, 6))) for _ in range(2)]
    llm = engine(model, mode, max_num_seqs=64, max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype)
    steps = traced(llm)
    assert len(llm.runner.kv_cache.layers[0]) == (2 if kv_cache_dtype in ("auto", "bfloat16") else 4)  # 8-bit: scales
    together = run(llm, requests)
    assert any(
        sum(s.num_new_tokens == 1 for s in step) >= 60 and any(s.num_new_tokens > 1 for s in step) for step in steps
    )
    llm.on_step = None
    assert together == alone(llm, requests)


def mixed(rng: random.Random, n: int) -> SamplingParams:
    """Seeded sampling with a random mix of every rule the sampler applies (on random weights' near-flat logits
    the nucleus is often wider than the sampler's head: its second pass, and the vocabulary-order draw, run too)."""
    pick = rng.choice
    return SamplingParams(
        temperature=pick([0, 0.05, 0.3, 1.0]),
        top_p=pick([1.0, 0.9, 0.3]),
        top_k=pick([0, 0, 5, 100]),
        min_p=pick([0, 0, 0.1, 0.9]),
        presence_penalty=pick([0, 0.5]),
        frequency_penalty=pick([0, 0.3]),
        repetition_penalty=pick([1, 1, 1.3]),
        logit_bias=pick([{}, {rng.randrange(8192): 4.0, rng.randrange(8192): -50.0}]),
        min_tokens=pick([0, 4]),
        stop_token_ids=[rng.randrange(8192)],
        seed=rng.randrange(2**64),
        max_tokens=n,
        ignore_eos=True,
        logprobs=pick([0, 2, 20]),
    )


@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_64_lanes_sampling_with_mixed_parameters(smollm2_shapes, mode):
    # Every row of the sampler's batched ops computed on its own: 64 lanes, each with its own temperature, top-k,
    # top-p, min-p, penalties, bias, min_tokens, seed and logprobs, together bit for bit as each alone.
    rng = random.Random(57)
    requests = [(random_prompt(rng, rng.randint(3, 40)), mixed(rng, rng.randint(6, 12))) for _ in range(64)]
    llm = engine("smollm2-shapes", mode, max_num_seqs=64, max_num_batched_tokens=1024)
    together = run(llm, requests)
    assert len({tuple(t for t, *_ in steps) for steps in together.values()}) == 64
    assert together == alone(llm, requests)


@pytest.fixture(scope="module")
def shared_prefixes(smollm2_shapes) -> list[tuple[list[int], SamplingParams]]:
    """16 requests: system prompts of 40, 100 and 260 tokens shared by 4 requests each, and 4 without."""
    rng = random.Random(16)
    systems = [random_prompt(rng, n) for n in (40, 100, 260)]
    return [
        (system + random_prompt(rng, rng.randint(5, 50)), greedy(rng.randint(4, 12)))
        for system in systems + [[]]
        for _ in range(4)
    ]


@pytest.mark.parametrize(
    "model, mode, kv_cache_dtype",
    [("smollm2-shapes", *m) for m in KV_MODES + [("int4", "auto"), ("int4 bfloat16", "int8")]] + FAMILY_MODES,
)
def test_lanes_alone_equal_lanes_together_in_every_path(families, shared_prefixes, model, mode, kv_cache_dtype):
    requests, kv = shared_prefixes, dict(kv_cache_dtype=kv_cache_dtype)
    expected = alone(engine(model, mode, max_num_batched_tokens=512, **kv), requests)
    for budget in (32, 64, 512):
        llm = engine(model, mode, max_num_batched_tokens=budget, enable_prefix_caching=True, **kv)
        assert run(llm, requests) == expected, budget
        assert llm.scheduler.prefix_hits > 0
    for preemption in ("recompute", "swap"):  # 24 blocks of 16 tokens: a few sequences at a time
        llm = engine(
            model, mode, num_kv_blocks=24, max_num_batched_tokens=64, preemption_mode=preemption, swap_space=0.05, **kv
        )
        assert run(llm, requests) == expected, preemption
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.swap_space.num_free_blocks == llm.scheduler.swap_space.num_blocks


# Every kernel variant this CPU can run, in the modes whose code differs from the best variant's: the best ("") and
# AVX2 in all; AVX-512 without BF16 in bfloat16 (FMA pairs, not vdpbf16ps) and int4 (vpmaddubsw, not VNNI's vpdpbusd);
# the VNNI variants in int4, where VNNI acts. Off: the fallback.
VARIANTS = [(m, mode) for m in ("", "avx2", "off") for mode in ("float32", "bfloat16", "int4")]
VARIANTS += [("avx512", "bfloat16"), ("avx512", "int4"), ("avx2_vnni", "int4"), ("avx512_vnni", "int4")]


@pytest.mark.parametrize("matmul, mode", VARIANTS)
def test_lanes_in_an_engine_of_few_sequences(smollm2_shapes, shared_prefixes, mode, matmul, monkeypatch):
    # The CPU matmul kernel (cpu_matmul; "": the best ISA here, or one forced) computes a row alike in any
    # batch, so max_num_seqs does not change a lane's bits. Off, the fallback: with max_num_seqs 4 matmuls run 16
    # rows at a time (cpu.row_tile), so a 64-token budget's prefill chunks take several tiles beside the decodes.
    if matmul not in ("", "off") and not cpu_matmul.supported(matmul):
        pytest.skip(f"this CPU has no {matmul}")
    monkeypatch.setenv("LANESERVE_CPU_MATMUL", matmul)
    llm = engine(smollm2_shapes, mode, max_num_seqs=4, max_num_batched_tokens=64)
    kernels = [m for m in llm.runner.model.modules() if isinstance(m, cpu_matmul.Linear)]
    assert llm.runner.model.attention.kernel == (matmul != "off")  # generated tokens: token_attention, or torch's
    if matmul == "off":
        assert not kernels and {m.tile for m in llm.runner.model.modules() if isinstance(m, cpu.TiledLinear)} == {16}
        assert run(llm, shared_prefixes) == alone(llm, shared_prefixes)
    else:
        assert {m.isa for m in kernels} == {cpu_matmul.isa()} and len(kernels) == 2 * 4 + 1  # 2 layers of 4, LM head
        assert run(llm, shared_prefixes) == alone(
            engine(smollm2_shapes, mode, max_num_batched_tokens=512), shared_prefixes
        )


@pytest.mark.parametrize("mode", ["float32", "bfloat16"])
def test_lanes_with_speculation_equal_lanes_alone_without(smollm2_shapes, shared_prefixes, mode):
    # Drafts computed in a lane's spare rows and verified change none of its bits: 64 lanes together (drafts as
    # lanes finish), prefix caching, recompute and swap, against each request alone with speculation off.
    rng = random.Random(64)
    requests = [(random_prompt(rng, rng.randint(3, 60)), greedy(rng.randint(10, 30))) for _ in range(64)]
    llm = engine(smollm2_shapes, mode, max_num_seqs=64, max_num_batched_tokens=256, num_speculative_tokens=4)
    assert run(llm, requests) == alone(engine(smollm2_shapes, mode), requests)
    assert llm.num_accepted_tokens > 0
    expected = alone(engine(smollm2_shapes, mode), shared_prefixes)
    for knobs in (
        dict(enable_prefix_caching=True, max_num_batched_tokens=32),
        *(
            dict(num_kv_blocks=24, max_num_batched_tokens=64, preemption_mode=p, swap_space=0.05)
            for p in ("recompute", "swap")
        ),
    ):
        llm = engine(smollm2_shapes, mode, num_speculative_tokens=4, **knobs)
        assert run(llm, shared_prefixes) == expected, knobs
        assert llm.num_accepted_tokens > 0, knobs
