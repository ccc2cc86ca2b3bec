"""Speculative decoding is exact: with n-gram drafts on, every request's tokens, logprobs, top logprobs, text and
finish reason are bit for bit those without, in every path (sampling, penalties, stops inside an accepted run of
drafts, max_tokens mid-run, prefix caching, preemption, static batching, 1 to 64 lanes). On random weights in
SmolLM2's shapes, whose greedy and low-temperature outputs fall into loops: drafts are proposed and accepted
(each test asserts it, so that it can fail), and an accepted draft's logits are compared bit for bit."""

import argparse
import random
from collections import defaultdict

import pytest

from cli import add_cli_args, from_cli_args
from config import EngineConfig
from conftest import traced
from engine import LLM, SamplingParams
from speculation import NgramIndex


def engine(model: str, k: int, **knobs) -> LLM:
    return LLM(
        model=model,
        dummy_weights=True,
        device="cpu",
        num_speculative_tokens=k,
        **{"num_kv_blocks": 1024, "dtype": "bfloat16", **knobs},
    )


def run(llm: LLM, requests: list[tuple[list[int] | str, SamplingParams]]) -> tuple[dict[str, list], dict[str, tuple]]:
    """Every request's (token, logprob, top logprobs) in order, and its (text, finish reason, stop reason, length);
    llm.accepted[request id] lists the indices of its tokens that came as accepted drafts (a step's second
    token of a request on)."""
    for i, (ids, params) in enumerate(requests):
        llm.add_request(ids, params, str(i))
    got, ends, llm.accepted = defaultdict(list), {}, defaultdict(list)
    while llm.has_unfinished():
        seen = set()
        for out in llm.step():
            lp = out.logprob
            got[out.request_id].append((out.token_ids[-1], lp and lp.logprob, lp and lp.top))
            if out.request_id in seen:
                llm.accepted[out.request_id].append(len(got[out.request_id]) - 1)
            seen.add(out.request_id)
            if out.finished:
                ends[out.request_id] = (out.text, out.finish_reason, out.stop_reason, len(out.token_ids))
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks  # no block left behind by a draft
    return dict(got), ends


def check_same(model: str, requests, k: int = 4, **knobs) -> LLM:
    """Run requests without and with speculation; the same outputs, and some drafts accepted. The engine with
    speculation is returned for more checks."""
    expected = run(engine(model, 0, **knobs), requests)
    llm = engine(model, k, **knobs)
    assert run(llm, requests) == expected
    assert llm.num_accepted_tokens > 0 and llm.accepted, (llm.num_draft_tokens, llm.num_accepted_tokens)
    return llm


def looping(rng: random.Random, n: int) -> list[int]:
    """A prompt that repeats a random pattern: its n-grams recur, and the model's loops follow."""
    pattern = [rng.randrange(300, 8192) for _ in range(rng.randint(3, 12))]
    return (pattern * (n // len(pattern) + 1))[:n]


def mixed(rng: random.Random, count: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded low-temperature requests, with logprobs, penalties, logit_bias, min_tokens."""
    kinds = [
        dict(temperature=0),
        dict(temperature=0.2, seed=7),
        dict(temperature=0.3, top_k=20, seed=3),
        dict(temperature=0, repetition_penalty=1.1),
        dict(temperature=0.2, presence_penalty=0.5, seed=1),
        dict(temperature=0, frequency_penalty=0.3, logit_bias={301: 2.0}),
        dict(temperature=0, min_tokens=8),
    ]
    return [
        (
            looping(rng, rng.randint(8, 60)),
            SamplingParams(max_tokens=rng.randint(5, 40), logprobs=2, ignore_eos=True, **kinds[i % len(kinds)]),
        )
        for i in range(count)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("lanes", [1, 4, 64])
def test_same_outputs_with_and_without_speculation(smollm2_shapes, lanes):
    rng = random.Random(lanes)
    requests = mixed(rng, 7 if lanes == 1 else lanes)
    check_same(smollm2_shapes, requests, max_num_seqs=lanes, max_num_batched_tokens=256)


PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time, and books are due back within three weeks."
)


@pytest.fixture(scope="module")
def smollm2():
    """The real model: asked to repeat a paragraph, it copies it, and its drafts (from the prompt) are accepted."""
    engines = {k: LLM(device="cpu", num_kv_blocks=256, num_speculative_tokens=k) for k in (0, 6)}
    prompt = engines[0].tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this paragraph word for word, changing 'five' to 'ten':\n\n{PARAGRAPH}"}]
    )
    return engines, prompt


@pytest.mark.slow
def test_stops_and_max_tokens_inside_an_accepted_run(smollm2):
    # A stop token, a stop string and max_tokens each end the output on a token that came as an accepted draft,
    # with further accepted drafts of its step dropped.
    engines, prompt = smollm2
    greedy = dict(temperature=0, max_tokens=60, logprobs=3)
    got, _ = run(engines[6], [(prompt, SamplingParams(**greedy))])
    tokens, accepted = [t for t, *_ in got["0"]], engines[6].accepted["0"]
    inside = [i for i in accepted if i + 1 in accepted]  # an accepted draft followed by another in its step
    assert len(inside) >= 10, accepted

    def check(params: dict, where) -> None:
        out = run(engines[0], [(prompt, SamplingParams(**{**greedy, **params}))])
        assert run(engines[6], [(prompt, SamplingParams(**{**greedy, **params}))]) == out
        assert where(out[1]["0"][3] - 1), params  # the index of its last token

    first = [i for i in inside if tokens[i] not in tokens[:i]]
    check(dict(stop_token_ids=[tokens[first[0]]]), lambda last: last in inside)
    check(dict(stop_token_ids=[tokens[first[-1]]], min_tokens=first[-1] - 2), lambda last: last in inside)
    text = engines[0].tokenizer.decode(tokens[: inside[len(inside) // 2] + 1])
    check(dict(stop=[text[-6:]]), lambda last: last in accepted)
    check(dict(max_tokens=inside[len(inside) // 2] + 1), lambda last: last in inside)


@pytest.mark.slow
def test_seeded_sampling_on_the_real_model(smollm2):
    engines, prompt = smollm2
    params = SamplingParams(temperature=0.3, seed=5, max_tokens=50, logprobs=2, top_p=0.9, repetition_penalty=1.05)
    assert run(engines[6], [(prompt, params)]) == run(engines[0], [(prompt, params)])
    assert engines[6].accepted["0"] and engines[6].num_draft_tokens > engines[6].num_accepted_tokens  # rejections


@pytest.mark.slow
def test_prefix_caching_preemption_and_static_batching(smollm2_shapes):
    rng = random.Random(16)
    system = looping(rng, 100)
    requests = [(system + looping(rng, rng.randint(5, 30)), params) for _, params in mixed(rng, 12)]
    llm = check_same(smollm2_shapes, requests, enable_prefix_caching=True, max_num_batched_tokens=64)
    assert llm.scheduler.prefix_hits > 0
    for preemption in ("recompute", "swap"):  # 24 blocks of 16 tokens: a few sequences at a time
        llm = check_same(
            smollm2_shapes,
            requests,
            num_kv_blocks=24,
            max_num_batched_tokens=64,
            preemption_mode=preemption,
            swap_space=0.05,
        )
        assert llm.scheduler.num_preemptions > 0
        assert llm.scheduler.swap_space.num_free_blocks == llm.scheduler.swap_space.num_blocks
    check_same(smollm2_shapes, requests, scheduling="static", max_num_seqs=4)


def test_drafts_only_in_spare_rows(smollm2_shapes):
    # Lanes share DRAFT_ROWS: one lane drafts up to num_speculative_tokens, eight or more decoding lanes none.
    import speculation

    llm = engine(smollm2_shapes, 6)
    steps = traced(llm)
    llm.generate([looping(random.Random(1), 30)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert max(s.num_new_tokens for step in steps[1:] for s in step) == 7
    llm = engine(smollm2_shapes, 6)
    rng = random.Random(2)
    llm.generate(
        [looping(rng, 30) for _ in range(speculation.DRAFT_ROWS)],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    )
    assert llm.num_draft_tokens == 0


def test_ngram_index_matches_a_rescan():
    # The incremental index proposes what a rescan of the whole history finds: the latest earlier occurrence of
    # the longest suffix of 2 to 4 tokens, continued periodically past the end.
    def rescan(tokens: list[int], k: int) -> list[int]:
        for n in range(4, 1, -1):
            for end in range(len(tokens) - 1, n - 1, -1):
                if tokens[end - n : end] == tokens[-n:]:
                    draft = tokens[end : end + k]
                    while len(draft) < k:
                        draft.append(draft[len(draft) - (len(tokens) - end)])
                    return draft
        return []

    rng = random.Random(0)
    for _ in range(20):
        index, tokens = NgramIndex(2, 4, 5), []
        for _ in range(200):
            tokens += [rng.randrange(4)] * rng.choice([1, 1, 2])
            assert index.propose(tokens, 5) == rescan(tokens, 5)


def test_a_lane_drafts_one_more_than_its_last_verify_accepted():
    # Text that stopped repeating gets one draft a step, not the lane's whole share, and after a draft rejected at
    # its first token none for a while; a draft accepted whole doubles the next (the step's share still bounds it).
    index = NgramIndex(2, 4, 7)
    assert index.limit == 7
    index.verified(7, 2)
    assert index.limit == 3
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    for backoff in (1, 2, 4):  # rejected at the first token: none for 1, 2, 4 steps (the index still grows)
        index.verified(3, 0)
        assert index.limit == 1
        for _ in range(backoff):
            assert index.propose(tokens, 1) == []
        assert index.propose(tokens, 1) == [3]
    index.verified(1, 1)
    assert index.limit == 2
    index.verified(2, 2)
    assert index.limit == 4 and index.propose(tokens + [3, 4], 4) == [5, 6, 1, 2]
    index.verified(4, 0)  # the backoff starts again from 1 after an acceptance
    assert index.propose(tokens + [3, 4], 4) == [] and index.propose(tokens + [3, 4], 4) == [5, 6, 1, 2]


def test_speculative_config_flag():
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 5, "prompt_lookup_min": 3}',
        ]
    )
    c = from_cli_args(args)
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (8, 5, 3)
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 0}'])
    assert from_cli_args(args).num_speculative_tokens == 0  # 0 turns it off
    args = parser.parse_args(["--num-speculative-tokens", "4", "--speculative-config", '{"num_speculative_tokens": 4}'])
    assert from_cli_args(args).num_speculative_tokens == 4  # the same value twice: no conflict
    args = parser.parse_args(["--num-speculative-tokens", "4", "--speculative-config", '{"num_speculative_tokens": 0}'])
    with pytest.raises(
        ValueError, match="--num-speculative-tokens 4 and --speculative-config's num_speculative_tokens 0"
    ):
        from_cli_args(args)  # which one was meant would be a guess
    for bad in ('{"method": "eagle"}', "{nope", '["ngram"]', '{"method": "ngram", "draft_model": "x"}'):
        with pytest.raises(argparse.ArgumentError, match="speculative-config"):
            parser.parse_args(["--speculative-config", bad])
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        from_cli_args(parser.parse_args(["--speculative-config", '{"prompt_lookup_min": 5, "prompt_lookup_max": 2}']))
    with pytest.raises(ValueError, match="num_speculative_tokens must be int"):
        EngineConfig(num_speculative_tokens="8")


def test_metrics_count_drafts_and_accepted(smollm2_shapes):
    from server.metrics import Histogram, prometheus_text

    llm = engine(smollm2_shapes, 4)
    llm.generate([looping(random.Random(3), 20)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    h = Histogram([1.0])
    text = prometheus_text("m", llm.stats(), True, h, h, h, h, 16, "auto")
    drafts, accepted = llm.num_draft_tokens, llm.num_accepted_tokens
    assert drafts >= accepted > 0
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {drafts}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}' in text
