"""The scheduler under pressure: preemption (recompute and swap), prefix caching, static mode,
stop strings, logprobs and configuration checks, all through the real engine."""

import hashlib
import os
import random
from array import array
from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from kv_cache import BlockManager, KVCache, KVShape
from sampler import Sampled

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
    "every jolly sphinx of black quartz near my river bank"
).split()


def make_prompts(llm, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))) for _ in range(n)]


def run(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)  # nothing leaked
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def roomy():
    # max_num_seqs=16: 16-row matmul tiles (cpu.row_tile) instead of 64, for these few sequences.
    return LLM(num_kv_blocks=512, max_num_batched_tokens=256, max_num_seqs=16, dtype="float32", device="cpu")


def small(path: str, **knobs) -> LLM:
    """An engine on SmolLM2's first 4 layers (conftest.smollm2_4_layers), in float32."""
    return LLM(model_path=path, dtype="float32", device="cpu", **{"max_num_batched_tokens": 256, **knobs})


def lengths_params(n: int, seed: int = 1) -> list[SamplingParams]:
    rng = random.Random(seed)
    return [SamplingParams(temperature=0, max_tokens=rng.randint(4, 24), ignore_eos=True) for _ in range(n)]


@pytest.mark.slow
def test_unchunked_recompute_of_a_sequence_longer_than_the_budget(smollm2_4_layers):
    # Without chunked prefill a prompt runs whole, but a sequence recomputed after preemption holds more
    # tokens than the budget: it must still come back, in budget-sized pieces. Two 100-token prompts
    # fill the 14 blocks; the second is preempted with 100 + a dozen tokens, over the 104 budget.
    prompts = [list(range(1000, 1100)), list(range(2000, 2100))]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = run(small(smollm2_4_layers, num_kv_blocks=512), prompts, params)
    tight = small(smollm2_4_layers, num_kv_blocks=14, max_num_batched_tokens=104, enable_chunked_prefill=False)
    ids = [tight.add_request(p, params) for p in prompts]
    done = {}
    for _ in range(1000):  # a sequence that can never come back would loop here forever
        done.update((o.request_id, o.token_ids) for o in tight.step() if o.finished)
        if not tight.has_unfinished():
            break
    assert [done.get(i) for i in ids] == expected
    assert tight.stats()["num_preemptions"] > 0


def test_request_that_can_never_fit_is_rejected():
    tiny = LLM(num_kv_blocks=4, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="KV blocks"):
        tiny.add_request(list(range(60)), SamplingParams(max_tokens=10))
    assert not tiny.has_unfinished()


@pytest.fixture(scope="module")
def shared_prefix(smollm2_4_layers):
    """(prompts, params, outputs) of 16 requests that start with the same ten blocks, run without the cache."""
    llm = small(smollm2_4_layers, num_kv_blocks=512)
    system = llm.tokenizer.encode(" ".join(WORDS * 6))[:160]  # ten full blocks
    prompts, params = [system + p for p in make_prompts(llm, 16, seed=7)], lengths_params(16, seed=3)
    return prompts, params, run(llm, prompts, params)


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_blocks", [512, 40])
def test_prefix_caching(smollm2_4_layers, shared_prefix, num_kv_blocks):
    prompts, params, expected = shared_prefix
    cached = small(smollm2_4_layers, num_kv_blocks=num_kv_blocks, enable_prefix_caching=True)
    first = cached.generate(prompts[:1], params[:1])[0]
    rest = cached.generate(prompts[1:], params[1:])
    assert [o.token_ids for o in [first] + rest] == expected
    assert first.num_cached_tokens == 0
    if num_kv_blocks == 512:
        assert all(o.num_cached_tokens >= 160 for o in rest)
    else:  # a pool this small forces preemption while cached blocks are shared
        assert cached.stats()["num_preemptions"] > 0
        assert sum(o.num_cached_tokens for o in rest) >= 160
    stats = cached.stats()
    assert stats["prefix_cache_hits"] >= sum(o.num_cached_tokens for o in rest)
    bm = cached.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def finish_steps(engine, prompts, params) -> list[int]:
    """The step at which each request's final output came back."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished_at, step = {}, 0
    while engine.has_unfinished():
        step += 1
        finished_at.update({o.request_id: step for o in engine.step() if o.finished})
    return [finished_at[i] for i in ids]


@pytest.mark.slow
def test_static_vs_continuous_mixed_workload(tiny):
    # Scheduling order, not numerics: a tiny model keeps these 200-odd steps quick.
    engines = {
        mode: LLM(
            model=tiny,
            dummy_weights=True,
            num_kv_blocks=512,
            max_num_batched_tokens=256,
            scheduling=mode,
            max_num_seqs=8,
            device="cpu",
        )
        for mode in ("continuous", "static")
    }
    prompts = make_prompts(engines["static"], 16, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 8 + [
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ] * 8
    # Continuous, 8 sequences: every short request is done before any long one.
    order = finish_steps(
        engines["continuous"],
        prompts[:4] + prompts[8:12] + prompts[4:8] + prompts[12:],
        params[:4] + params[8:12] + params[4:8] + params[12:],
    )
    short, long = order[:4] + order[8:12], order[4:8] + order[12:]
    assert max(short) < min(long)
    # Static, same arrival order: the first batch mixes 4 short and 4 long requests, and its short
    # ones come back only with its longest sequence; the remaining shorts wait for that whole batch.
    order = finish_steps(
        engines["static"],
        prompts[:4] + prompts[8:12] + prompts[4:8] + prompts[12:],
        params[:4] + params[8:12] + params[4:8] + params[12:],
    )
    first_batch = order[:8]
    assert len(set(first_batch)) == 1
    assert min(order[8:12]) > max(first_batch)


def test_static_mode_gives_nothing_for_an_aborted_request(tiny):
    # Its result was held for the batch's end when it was aborted.
    llm = LLM(model=tiny, dummy_weights=True, device="cpu", scheduling="static", num_kv_blocks=16)
    llm.add_request([1, 2], SamplingParams(max_tokens=1, ignore_eos=True), "short")
    llm.add_request([1, 2], SamplingParams(max_tokens=5, ignore_eos=True), "long")
    assert [o.request_id for o in llm.step()] == ["long"]
    llm.abort("short")
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == ["long"] * 4


@pytest.mark.parametrize("next_batch", [False, True])
def test_static_batch_ended_by_an_abort_answers_at_once(tiny, next_batch):
    # Its last running sequence aborted, a batch is over: the results it held go out at the next step (they
    # waited forever when nothing else came; else until the next batch's end), not with a later batch.
    llm = LLM(model=tiny, dummy_weights=True, device="cpu", scheduling="static", num_kv_blocks=16)
    llm.add_request([1, 2], SamplingParams(max_tokens=1, ignore_eos=True), "short")
    llm.add_request([1, 2], SamplingParams(max_tokens=5, ignore_eos=True), "long")
    assert [o.request_id for o in llm.step()] == ["long"]
    llm.abort("long")
    if next_batch:
        llm.add_request([3, 4], SamplingParams(max_tokens=3, ignore_eos=True), "next")
    assert [(o.request_id, o.finished) for o in llm.step()] == [("short", True)] + [("next", False)] * next_batch
    assert llm.has_unfinished() == next_batch


@pytest.mark.slow
def test_stop_string_across_tokens(roomy):
    prompt = roomy.tokenizer.apply_chat_template([{"role": "user", "content": "Write two sentences about the ocean."}])
    free = roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    pieces = [roomy.tokenizer.decode([t]) for t in free.token_ids]
    # A stop string made of the end of one token and the start of the next.
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1].strip())
    stop = pieces[i][-1:] + pieces[i + 1][:2]
    cut = free.text.index(stop)
    out = roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]


def test_logprobs(roomy):
    outs = []
    rid = roomy.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    while roomy.has_unfinished():
        outs += [o for o in roomy.step() if o.request_id == rid]
    for o in outs:
        lp = o.logprob
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the most likely
        assert lp.top[0][1] == pytest.approx(lp.logprob) and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=12),
        dict(max_num_batched_tokens=8),
        dict(max_model_len=10**6),
        dict(num_kv_blocks=-1),
        dict(max_num_seqs=0),
        dict(scheduling="fifo"),
        dict(preemption_mode="drop"),
        dict(kv_cache_memory=-1),
        dict(kv_cache_dtype="fp8"),
    ],
)
def test_impossible_config_rejected(bad):
    with pytest.raises(ValueError):
        LLM(device="cpu", **bad)


@pytest.mark.slow
def test_text_held_for_a_possible_stop_string_is_released_at_eos(roomy):
    prompt = roomy.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    free = roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert free.finish_reason == "stop" and free.text.endswith(".")  # ended by EOS, right after a "."
    out = roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=32, stop=[".zzz"]))[0]
    assert out.text == free.text and out.finish_reason == "stop"


def test_prefix_cache_keys_are_a_sha256_chain():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    ids, table = list(range(13)), []
    bm.allocate(table, 13)
    bm.publish(table, ids, 0, 13)
    keys = [bm.block_hash[b] for b in table]
    assert keys[0] == hashlib.sha256(array("q", ids[:4]).tobytes()).digest()
    assert keys[1] == hashlib.sha256(keys[0] + array("q", ids[4:8]).tobytes()).digest()
    assert keys[3] is None  # the partial last block has no key
    # A key names its whole prefix: the same block after another first block is another key.
    shared, other = [], []
    assert bm.match_prefix(shared, ids[:8] + [99] * 5) == 8 and shared == table[:2]
    assert bm.match_prefix(other, [99] + ids[1:]) == 0 and other == []


def test_stop_strings_count_from_min_tokens_on(tiny):
    # As in vLLM: before min_tokens, a stop string ends nothing (its text goes out), like a stop token.
    llm = LLM(model=tiny, dummy_weights=True, device="cpu", dtype="float32", num_kv_blocks=16)
    a = SamplingParams(temperature=0, max_tokens=5, logit_bias={ord("a"): 100}, ignore_eos=True, stop=["a"])
    for min_tokens, text in [(0, ""), (1, ""), (2, "a"), (5, "aaaa")]:
        out = llm.generate([[ord("x")]], replace(a, min_tokens=min_tokens))[0]
        assert (out.text, out.finish_reason, out.stop_reason, len(out.token_ids)) == (
            text,
            "stop",
            "a",
            max(min_tokens, 1),
        )


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_prefill_takes_whatever_budget_the_decodes_leave(tiny):
    # --max-num-seqs 256 --max-num-batched-tokens 256: while 250 sequences decode, a 4,000-token prompt takes
    # the 6 tokens a step they leave (cut anywhere), so its prefill ends after ceil(4000 / 6) steps. The
    # forward pass is stubbed: this is about who runs, not what they compute.
    llm = LLM(
        model=tiny,
        dummy_weights=True,
        max_num_seqs=256,
        max_num_batched_tokens=256,
        num_kv_blocks=20000,
        dtype="float32",
        device="cpu",
    )
    llm.runner.run = lambda scheduled, swap_out, swap_in: [
        Sampled(s, [7], [None], [None]) for s, n in scheduled if s.num_computed_tokens + n == s.num_tokens
    ]
    for i in range(250):
        llm.add_request([5 + i], SamplingParams(max_tokens=5000, ignore_eos=True))
    llm.step()
    llm.add_request(list(range(10, 4010)), SamplingParams(max_tokens=1), "long")
    steps = 0
    while not any(out.request_id == "long" for out in llm.step()):
        steps += 1
    assert steps + 1 == -(-4000 // 6)


def test_prefix_cache_shares_prompt_blocks_only(tiny):
    # A second turn's prompt holds the first turn's prompt and reply. Only the first prompt's full blocks
    # are shared: on CPU a prompt token's attention runs otherwise than a generated token's
    # (cpu.BucketedAttention), so the reply's blocks do not hold what the new prompt computes there, and
    # the second turn's tokens are those of an engine that never saw the first.
    knobs = dict(model=tiny, dummy_weights=True, num_kv_blocks=64, dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(enable_prefix_caching=True, **knobs)
    first = llm.generate([list(range(100, 140))], greedy)[0]  # blocks of 16: 2 of prompt, 1 mixed, 1 of reply
    second = first.prompt_token_ids + first.token_ids + list(range(200, 210))
    out = llm.generate([second], greedy)[0]
    assert out.num_cached_tokens == 32
    assert out.token_ids == LLM(**knobs).generate([second], greedy)[0].token_ids


def test_cache_salt_isolates_prefixes(tiny):
    # vLLM's cache_salt: a prompt's blocks are shared only between requests of equal salts (no salt is a salt
    # of its own), so one tenant cannot time another's prompts; with isolation on, none without a salt share.
    knobs = dict(model=tiny, dummy_weights=True, num_kv_blocks=64, dtype="float32", device="cpu")
    llm, prompt = LLM(enable_prefix_caching=True, **knobs), list(range(100, 160))  # 3 full blocks to share

    def run(engine: LLM, salt: str | None):
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, cache_salt=salt))[0]
        return out.num_cached_tokens, out.token_ids

    alone = LLM(**knobs).generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    assert run(llm, "tenant a") == (0, alone)
    assert run(llm, "tenant b") == (0, alone)  # another salt: its own blocks
    assert run(llm, None) == (0, alone)  # no salt: not tenant a's either
    assert run(llm, "tenant a") == (48, alone)  # the same salt shares, and changes no bit
    assert run(llm, None) == (48, alone)
    assert len(llm.block_manager.cached) == 9  # 3 keyed blocks for each of the three salts
    isolated = LLM(enable_prefix_caching=True, prefix_cache_isolation=True, **knobs)
    assert [run(isolated, None)[0] for _ in range(2)] == [0, 0]
    assert [run(isolated, "shared")[0] for _ in range(2)] == [0, 48]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_swap_space_takes_no_memory_until_used(dtype):
    # 1 GiB of swap space for a tiny model: its pages are mapped only once swapped blocks are written.
    kv = KVShape(2, 1, 4)
    blocks = 2**30 // kv.bytes_per_block(2, dtype)
    before = resident_bytes()
    cache = KVCache(kv, num_blocks=2, block_size=2, dtype=dtype, device="cpu", num_swap_blocks=blocks)
    assert resident_bytes() - before < 2**26
    cache.swap([(0, blocks - 1)], [])
    assert resident_bytes() - before < 2**26
    # One allocation for every layer: pinned for a GPU, a layer's K or V alone would be rounded up to a power of two.
    assert len({t.untyped_storage().data_ptr() for layer in cache.host for t in layer}) == 1


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn], ids=str)
def test_swap_copies_out_before_in(dtype):
    # One step may swap a sequence out and another in onto the very blocks the first one left. An 8-bit cache's
    # scales (k_scale, v_scale after k and v) move with their blocks.
    cache = KVCache(KVShape(2, 1, 4), num_blocks=2, block_size=2, dtype=dtype, device="cpu", num_swap_blocks=2)
    assert [len(layer) for layer in cache.layers + cache.host] == [2 if dtype == torch.float32 else 4] * 4
    for i, (layer, host) in enumerate(zip(cache.layers, cache.host)):
        for j, (t, h) in enumerate(zip(layer, host)):
            t[0] = 1.0 + 4 * i + j  # device block 0: the sequence going out
            h[1] = -1.0 - 4 * i - j  # host block 1: the one coming back
    cache.swap([(0, 0)], [(1, 0)])
    for i, (layer, host) in enumerate(zip(cache.layers, cache.host)):
        for j, (t, h) in enumerate(zip(layer, host)):
            assert (h[0].float() == 1.0 + 4 * i + j).all() and (t[0].float() == -1.0 - 4 * i - j).all(), (i, j)
            assert (t[1].float() == 0).all() and t.dtype == h.dtype and t.shape[1:] == h.shape[1:]
