"""The CUDA engine against the CPU engine, on the same seeded random weights in float32 (the GPU test machine
has no checkpoint): SmolLM2's shapes (GQA 9:3, head_dim 64), a head_dim-128 model, Qwen3's and Gemma 3's
arithmetic (q/k norms; a sliding window of 32 keys at head_dim 256); graphs on and off, 8-bit caches, n-gram
drafts, prefix hits, swapping, host syncs, a second GPU. Skipped without CUDA; .ci/gpu runs them."""

import dataclasses
import random

import pytest
import torch
from test_speculation import looping

import weights
from engine import LLM
from model import ModelConfig
from sequence import SamplingParams

pytestmark = pytest.mark.cuda

HEAD_DIM_128 = ModelConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    rope_theta=500000.0,
)
QWEN3_SHAPES = dataclasses.replace(HEAD_DIM_128, rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True)
GEMMA3_SHAPES = dataclasses.replace(
    QWEN3_SHAPES,
    num_key_value_heads=1,
    head_dim=256,
    gemma=True,
    query_pre_attn_scalar=256,
    sliding_window=32,
    sliding_window_pattern=3,
    num_hidden_layers=3,
    rope_local_theta=10000.0,
)
# Byte prompts of mixed lengths (the random model's tokenizer is byte-level), several past the 64-token budget.
PROMPTS = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog. " * (i * i % 7) for i in range(10)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)  # logprobs: how near a tie


@pytest.fixture(autouse=True)
def same_weights_everywhere(monkeypatch):
    # Random weights drawn on the CPU whatever the device, so that both engines get the same numbers.
    draw = weights.dummy_weights
    monkeypatch.setattr(
        weights, "dummy_weights", lambda config, dtype, seed, device, *shard: draw(config, dtype, seed, "cpu", *shard)
    )
    for name, config in (
        ("head-dim-128", HEAD_DIM_128),
        ("qwen3-shapes", QWEN3_SHAPES),
        ("gemma3-shapes", GEMMA3_SHAPES),
    ):
        monkeypatch.setitem(weights.PRESETS, name, config)


def generate(device: str, model: str, prompts=PROMPTS, params=GREEDY, **kwargs) -> list[list[tuple[int, float]]]:
    """Each prompt's greedy tokens, each with the gap between the two likeliest logprobs of its step."""
    llm = LLM(
        model=model,
        dummy_weights=True,
        device=device,
        dtype="float32",
        max_num_batched_tokens=64,
        **{"num_kv_blocks": 512, **kwargs},
    )
    return run(llm, prompts, params)


def run(llm: LLM, prompts, params=GREEDY) -> list[list[tuple[int, float]]]:
    ids, tokens = [llm.add_request(p, params) for p in prompts], {}
    while llm.has_unfinished():
        for out in llm.step():
            (_, first), (_, second) = out.logprob.top
            tokens.setdefault(out.request_id, []).append((out.token_ids[-1], first - second))
    return [tokens[i] for i in ids]


def assert_same_tokens(gpu: list[list[tuple[int, float]]], cpu: list[list[tuple[int, float]]]) -> None:
    """The same tokens; a failure says where they part and how near a tie the CPU's step was there (the seeded
    prompts' smallest gap is 7.7e-4: float32 rounding is orders of magnitude below it, a bug is not)."""
    for i, (a, b) in enumerate(zip(gpu, cpu, strict=True)):
        for j, ((token, _), (expected, gap)) in enumerate(zip(a, b, strict=True)):
            assert token == expected, (
                f"prompt {i}, token {j}: {token} on CUDA, {expected} on the CPU, whose two "
                f"likeliest were {gap:.2e} apart in logprob"
            )


@pytest.mark.parametrize("model", ["smollm2-135m", "head-dim-128", "qwen3-shapes", "gemma3-shapes"])
def test_cuda_engine_matches_cpu_with_and_without_graphs(model):
    # The kernel refuses head_dim 256 in float32 (a row would span two warps): Gemma's shapes take an 8-bit cache.
    kv = dict(kv_cache_dtype="int8") if model == "gemma3-shapes" else {}
    cpu = generate("cpu", model, **kv)
    assert_same_tokens(generate("cuda", model, **kv), cpu)
    assert_same_tokens(generate("cuda", model, enforce_eager=True, **kv), cpu)
    if kv:
        with pytest.raises(ValueError, match="head_dim 64 or 128, or 256"):
            generate("cuda", model)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_8bit_cache_matches_cpu(kv):
    # Both store the same codes and scales (test_attention checks the store bit for bit); the kernel dequantizes
    # them in registers, the CPU before its matmuls.
    assert_same_tokens(
        generate("cuda", "smollm2-135m", kv_cache_dtype=kv), generate("cpu", "smollm2-135m", kv_cache_dtype=kv)
    )


def test_a_bfloat16_cache_beside_float32_is_for_the_cpu():
    # The kernel reads a cache in the query's dtype, or 8-bit codes: one line, before the KV pool is allocated.
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 beside --dtype float32 runs on a CPU only"):
        generate("cuda", "smollm2-135m", kv_cache_dtype="bfloat16")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_drafts_match_cpu_without_them(eager):
    # A step with drafts runs a sequence's several query rows through the varlen path, eagerly; the decode-only
    # steps between keep their graphs. Looping prompts make the random model loop, so drafts are accepted.
    rng = random.Random(0)
    prompts = [looping(rng, rng.randint(8, 60)) for _ in range(6)]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    llm = LLM(
        model="smollm2-135m",
        dummy_weights=True,
        device="cuda",
        dtype="float32",
        num_kv_blocks=512,
        max_num_batched_tokens=64,
        num_speculative_tokens=8,
        enforce_eager=eager,
    )
    got = run(llm, prompts, params)
    assert llm.num_accepted_tokens > 0, (llm.num_draft_tokens, llm.num_accepted_tokens)
    assert_same_tokens(got, generate("cpu", "smollm2-135m", prompts, params))


@pytest.mark.parametrize(
    "kwargs",
    [dict(enable_prefix_caching=True), dict(preemption_mode="swap", num_kv_blocks=40)],
    ids=["prefix-hits", "swapping"],
)
def test_prefix_hits_and_swapping_match_cpu(kwargs):
    # A shared 464-token prefix leaves one-token pieces beside decodes (graphs must pick the sampled rows);
    # a pool of 40 blocks forces sequences out to host memory and back.
    prefix = "You are a helpful assistant. " * 16 if "enable_prefix_caching" in kwargs else ""
    prompts = [prefix + p for p in PROMPTS]
    cpu = generate("cpu", "smollm2-135m", prompts, **kwargs)
    assert_same_tokens(generate("cuda", "smollm2-135m", prompts, **kwargs), cpu)


def test_decode_step_waits_on_the_device_once():
    llm = LLM(model="smollm2-135m", dummy_weights=True, device="cuda", dtype="float32", num_kv_blocks=256)
    modes = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, seed=1),
        dict(logprobs=2),
        dict(temperature=0.8, top_k=5, seed=2),
    ]
    for i, mode in enumerate(modes):
        llm.add_request(PROMPTS[i], SamplingParams(max_tokens=8, ignore_eos=True, **mode))
    llm.step()  # the prefill
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning, match="synchroniz") as caught:
            llm.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(caught) == 1, [str(w.message) for w in caught]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_second_gpu():
    assert_same_tokens(generate("cuda:1", "head-dim-128"), generate("cpu", "head-dim-128"))
