"""Prompt logprobs: vLLM's prompt_logprobs and the legacy completions' echo with logprobs (what lm-evaluation-harness
sends to score a multiple-choice answer). They come from the prefill chunks that already run, bit for bit the
logprobs the same positions get when generating, whatever the batch, the chunking, the prefix cache or preemption."""

import json
import random
import urllib.request

import openai
import pytest
import torch

from config import EngineConfig
from conftest import serving
from engine import LLM, SamplingParams

TEXT = "The capital of France is Paris, and the capital of Italy is Rome. Both are old cities on rivers."


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=64, dtype="float32", device="cpu")


def scored(llm: LLM, prompts: list, k: int = 5, **knobs) -> list:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k, **knobs)
    return [o.prompt_logprobs for o in llm.generate(prompts, params)]


def test_each_prompt_token_scored_as_generation_would(llm):
    ids = llm.tokenizer.encode(TEXT)
    [lps] = scored(llm, [ids])
    assert [x.token_id for x in lps] == ids[1:]  # the first token has no logprob
    # Position p's entry is the distribution generation sees after ids[:p + 1]: the same bits.
    gen = llm.generate(
        [ids[: p + 1] for p in range(len(ids) - 1)], SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    )
    assert [x.top for x in lps] == [o.logprob.top for o in gen]
    for x in lps:
        better = sum(lp > x.logprob for _, lp in x.top)
        assert x.rank == better + 1 or better == len(x.top) and x.rank > len(x.top)
        assert dict(x.top).get(x.token_id, x.logprob) == x.logprob


@pytest.mark.slow  # the inner loop keeps the bits test above
def test_matches_transformers(llm, hf_model):
    ids = llm.tokenizer.encode(TEXT)
    [lps] = scored(llm, [ids], 0)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    expected = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor([x.logprob for x in lps]), expected, atol=2e-3)


@pytest.mark.slow  # the inner loop keeps the bits test above
def test_same_bits_alone_among_others_chunked_and_preempted():
    # One engine with a tiny pool (preemptions by recompute) and a small budget (chunks cut anywhere).
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(20, 120))] for _ in range(26)]
    alone = LLM(num_kv_blocks=256, dtype="float32", device="cpu")
    expected = [scored(alone, [p], 3)[0] for p in prompts[:2]]
    crowded = LLM(num_kv_blocks=40, max_num_batched_tokens=48, max_num_seqs=26, dtype="float32", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=3)
    outs = crowded.generate(prompts, [asked, asked] + [greedy] * 24)
    assert crowded.scheduler.num_preemptions > 0
    assert [o.prompt_logprobs for o in outs[:2]] == expected
    assert all(o.prompt_logprobs is None for o in outs[2:])


def test_prefix_cache_is_skipped_not_wrong():
    llm = LLM(num_kv_blocks=256, enable_prefix_caching=True, dtype="float32", device="cpu")
    ids = llm.tokenizer.encode(TEXT * 3)
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))  # its blocks are now cached
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(ids) - 1
    assert out.prompt_logprobs == scored(LLM(num_kv_blocks=256, dtype="float32", device="cpu"), [ids], 2)[0]
    assert llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))[0].num_cached_tokens > 0


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs must"):
        SamplingParams(prompt_logprobs=value)


@pytest.fixture(scope="module")
def server():
    with serving(EngineConfig(num_kv_blocks=256, max_num_seqs=8, device="cpu", dtype="float32")) as s:
        yield s


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(server, llm):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.completions.create(model=server.model_names[0], prompt=TEXT, echo=True, logprobs=2, max_tokens=3,
                                  temperature=0)  # fmt: skip
    c, ids = r.choices[0], llm.tokenizer.encode(TEXT)
    lp = c.logprobs
    assert c.text.startswith(TEXT) and "".join(lp.tokens).startswith(TEXT)
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(ids)] == [x.logprob for x in scored(llm, [ids], 2)[0]]
    assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])  # the top 2, and the token itself if not among them
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    # Streamed: the same tokens and numbers.
    chunks = list(client.completions.create(model=server.model_names[0], prompt=TEXT, echo=True, logprobs=2,
                                            max_tokens=3, temperature=0, stream=True))  # fmt: skip
    streamed = [x for ch in chunks for c in ch.choices if c.logprobs for x in zip(c.logprobs.tokens,
                c.logprobs.token_logprobs, c.logprobs.text_offset)]  # fmt: skip
    assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))


def test_tokens_that_split_a_character_keep_their_own_keys_and_offsets(server, llm):
    """Part of a character is bytes:\\xNN, as OpenAI names it (decoded alone, every such token would be U+FFFD: one
    key in top_logprobs for many tokens, the chosen one's value overwritten), and text_offset counts characters of
    the text, a token that ends inside a character starting where it does."""
    prompt = "Emoji party: \U0001f389\U0001f38a\U0001f973 \u6211\u7231\u5317\u4eac"
    body = {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 6, "temperature": 0}
    status, r = post(server, "/v1/completions", body)
    lp, text = r["choices"][0]["logprobs"], r["choices"][0]["text"]
    assert status == 200 and text.startswith(prompt) and any(t.startswith("bytes:\\x") for t in lp["tokens"])
    raws = [bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in lp["tokens"]]
    assert b"".join(raws).decode("utf-8", "replace") == text  # every byte once, in order
    for i, (token, top) in enumerate(zip(lp["tokens"], lp["top_logprobs"])):
        assert top is None if i == 0 else top[token] == lp["token_logprobs"][i] and 5 <= len(top) <= 6
        start = len(b"".join(raws[:i]).decode("utf-8", "ignore"))  # the characters complete before it
        assert lp["text_offset"][i] == start <= len(text), (i, token)
    streamed = [x for ch in chunks(server, body) for x in zip(ch["tokens"], ch["text_offset"])]
    assert streamed == list(zip(lp["tokens"], lp["text_offset"]))


def chunks(server, body: dict) -> list[dict]:
    """A streamed completion's logprobs, chunk by chunk (raw SSE: the openai client's types are not needed)."""
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    return [c["logprobs"] for e in events for c in e["choices"] if c.get("logprobs")]


def test_max_tokens_0_with_echo_scores_without_generating(server, llm):
    status, r = post(server, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert status == 200
    c = r["choices"][0]
    assert c["text"] == TEXT and r["usage"]["completion_tokens"] == 0 and c["finish_reason"] == "length"
    assert c["logprobs"]["token_logprobs"][1:] == [x.logprob for x in scored(llm, [llm.tokenizer.encode(TEXT)])[0]]
    status, r = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 0})
    assert status == 400 and r["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_both_routes(server, llm):
    status, r = post(server, "/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1, "max_tokens": 1})
    assert status == 200
    got, ids = r["choices"][0]["prompt_logprobs"], llm.tokenizer.encode(TEXT)
    assert got[0] is None and len(got) == len(ids)
    for entry, x, token in zip(got[1:], scored(llm, [ids], 1)[0], ids[1:]):
        assert entry[str(token)]["logprob"] == x.logprob and entry[str(token)]["rank"] == x.rank
        assert entry[str(x.top[0][0])]["rank"] == 1 and len(entry) in (1, 2)
    messages = [{"role": "user", "content": "hi"}]
    status, r = post(server, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 1})
    assert status == 200 and r["prompt_logprobs"][0] is None
    assert len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_refused(server, body, param):
    status, r = post(server, "/v1/completions", {"prompt": TEXT, **body})
    assert status == 400 and r["error"]["param"] == param
