"""A streamed reply is the unstreamed one cut into pieces: with greedy sampling or a seed, for
/v1/completions and /v1/chat/completions, the deltas of each choice add up to the whole reply's text,
and finish_reason, logprobs (completions' tokens, token_logprobs, top_logprobs and text_offset, the
latter counted in the whole reply; chat's entries with their bytes and top_logprobs) and usage (the
final chunk of stream_options.include_usage) are the same. Hypothesis varies prompts (unicode, emoji,
text holding stop strings), stop strings (taken from a reply made without them, so that they cross
token boundaries, prefixes of each other, long ones that almost match), max_tokens, n, echo,
logprobs, skip_special_tokens, min_tokens, stop_token_ids, ignore_eos, and seeded sampling; on the
tiny random-weights model (gibberish bytes, odd UTF-8 splits, logit_bias towards byte tokens and
ChatML's specials) and on SmolLM2.

PARITY_HUNT=K runs K times the examples, with random seeds (a longer hunt, not for CI)."""

import http.client
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import note as _note
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from config import EngineConfig
from conftest import serving, serving_tiny

HUNT = int(os.environ.get("PARITY_HUNT", "0"))


def examples(n: int):
    return settings(
        max_examples=n * HUNT if HUNT else n,
        deadline=None,
        derandomize=not HUNT,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as test_serve.py's server: a busy 2-core box
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_server(one_thread):
    """Random weights, SmolLM2's vocabulary and the byte tokenizer; prefix caching on (README: a request's
    tokens and logprobs are the same, bit for bit, whether its prefix came from the cache or not)."""
    with serving_tiny(False, num_kv_blocks=256, enable_prefix_caching=True, max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def tight_server(one_thread):
    """tiny_server with a pool of 12 blocks (192 tokens) and 32 tokens a step: n sequences of a request, or two
    requests at once, preempt each other (recomputed) and have their prompts cut into chunks."""
    with serving_tiny(
        False,
        num_kv_blocks=12,
        enable_prefix_caching=True,
        max_model_len=192,
        max_num_batched_tokens=32,
        max_num_seqs=16,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def smol_server(one_thread):
    """SmolLM2-135M (the default checkpoint), float32, as test_serve.py's server."""
    with serving(
        EngineConfig(num_kv_blocks=512, max_num_seqs=16, device="cpu", dtype="float32"), log_requests=False
    ) as s:
        yield s


def note(text: str) -> None:
    if currently_in_test_context():  # shown with a failing example; the plain tests have their own message
        _note(text)


def post(server, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def whole(server, path: str, body: dict) -> dict:
    status, raw = post(server, path, {**body, "stream": False})
    assert status == 200, (status, raw, body)
    return json.loads(raw)


def streamed(server, path: str, body: dict) -> list[dict]:
    status, raw = post(server, path, {**body, "stream": True})
    assert status == 200, (status, raw, body)
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
    assert all(e.startswith("data: ") for e in events[:-1]), events
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert not any("error" in c for c in chunks), chunks
    return chunks


def assemble(chunks: list[dict], chat: bool, usage_chunk: bool) -> tuple[dict[int, dict], dict | None]:
    """Each choice's pieces put together (text, finish_reason, logprobs), checking the stream's shape; and the
    usage chunk's usage."""
    usage = None
    if usage_chunk:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"], chunks[-1]
        usage, chunks = chunks[-1]["usage"], chunks[:-1]
        assert all("usage" in c and c["usage"] is None for c in chunks)
    else:
        assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    per: dict[int, list[dict]] = {}
    for c in chunks:
        assert len(c["choices"]) == 1, c
        per.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    out = {}
    for i, pieces in per.items():
        reasons = [p["finish_reason"] for p in pieces]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1]), (i, reasons)  # once, last
        if chat:
            assert pieces[0]["delta"] == {"role": "assistant", "content": ""}, pieces[0]
            assert all("role" not in p["delta"] for p in pieces[1:])
            text = "".join(p["delta"].get("content") or "" for p in pieces)
            lps = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
            logprobs = {"content": [e for lp in lps for e in lp["content"]]} if lps else None
        else:
            text = "".join(p["text"] for p in pieces)
            lps = [p["logprobs"] for p in pieces if p["logprobs"] is not None]
            logprobs = (
                {
                    k: [x for lp in lps for x in lp[k]]
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
                }
                if lps
                else None
            )
        out[i] = {"text": text, "finish_reason": reasons[-1], "logprobs": logprobs}
    return out, usage


def check_parity(server, chat: bool, body: dict, order: str = "plain first") -> dict:
    """The request unstreamed and streamed ("plain first", "stream first", or "together": at once, so that
    they share steps); asserts they agree and returns the whole reply."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    usage_chunk = bool((body.get("stream_options") or {}).get("include_usage"))
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    if order == "together":
        with ThreadPoolExecutor(2) as pool:
            reply, chunks = pool.submit(whole, server, path, plain), pool.submit(streamed, server, path, body)
            reply, chunks = reply.result(), chunks.result()
    elif order == "stream first":
        chunks = streamed(server, path, body)
        reply = whole(server, path, plain)
    else:
        reply = whole(server, path, plain)
        chunks = streamed(server, path, body)
    got, usage = assemble(chunks, chat, usage_chunk)
    want = {
        c["index"]: {
            "text": c["message"]["content"] if chat else c["text"],
            "finish_reason": c["finish_reason"],
            "logprobs": c["logprobs"],
        }
        for c in reply["choices"]
    }
    assert sorted(want) == list(range(len(want)))
    note(f"request: {json.dumps(body, ensure_ascii=False)}")
    for i in want:
        assert got.get(i) == want[i], (i, got.get(i), want[i])
    assert sorted(got) == sorted(want)
    if usage_chunk:
        if server.config.num_kv_blocks < 256:  # evicted from the prefix cache or not: a matter of timing
            usage, reply_usage = (
                {k: v for k, v in u.items() if k != "prompt_tokens_details"} for u in (usage, reply["usage"])
            )
            assert usage == reply_usage
        else:  # the stop-less reply before them cached the same prompt blocks for both
            assert usage == reply["usage"]
    return reply


# Prompts: pieces that tokenize in odd ways (emoji sequences, combining marks, CJK, a special token's text,
# text that holds the stop strings used below), or any text.
PIECES = [
    "a",
    "b",
    " ",
    "\n",
    "\n\n",
    ".",
    ",",
    " the",
    " Paris",
    "é",
    "e\u0301",
    "€",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🇫🇷",
    "中文",
    "ß",
    "\t",
    "<|im_end|>",
    "<|im_start|>",
    "Hello",
    " world",
    "1, 2, 3,",
    "\ufffd",
]
prompts = st.one_of(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=10).map("".join), st.text(min_size=1, max_size=16)
)
FRAGMENTS = [".", "\n", ",", " the", "Paris", "\n\n", " ", "e", "😀", "\ufffd", "é", "1, 2", "The", "<|im_end|>"]
# Token ids on the tiny model: bytes of UTF-8 characters (é: C3 A9, €: E2 82 AC, 😀: F0 9F 98 80), a
# continuation byte alone, an invalid byte; <|endoftext|> (EOS), <|im_start|> (a control token: no text
# unless skip_special_tokens is false) and <|im_end|> (a stop token); some ordinary ids.
UTF8_GROUPS = [[0xC3, 0xA9], [0xE2, 0x82, 0xAC], [0xF0, 0x9F, 0x98, 0x80], [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0x41]]
TINY_IDS = [0x41, 0x80, 0xA9, 0xC3, 0xE2, 0xF0, 0xFF, 256, 257, 258, 300, 1000]


@st.composite
def tiny_bias(draw) -> dict:
    """logit_bias towards byte tokens and specials. The random model's logits lie within ~0.2 of each other:
    a bias of 5 makes its tokens the only candidates (sampled among, with a seed), 0.05-0.2 mixes them in."""
    kind = draw(st.sampled_from(["none", "utf8", "weak"]))
    if kind == "none":
        return {}
    if kind == "utf8":
        return {str(t): 5.0 for t in draw(st.sampled_from(UTF8_GROUPS))}
    return {
        str(t): draw(st.sampled_from([0.05, 0.1, 0.2, 0.4]))
        for t in draw(st.lists(st.sampled_from(TINY_IDS), min_size=1, max_size=5, unique=True))
    }


# Up to 80 bytes (on the tiny model, 80 tokens), repeated to fill a tight server's pool.
long_prompts = st.tuples(prompts, st.integers(1, 20)).map(
    lambda t: (t[0] * t[1]).encode()[:80].decode(errors="ignore") or "x"
)


@st.composite
def requests(draw, chat: bool, tiny: bool, tight: bool = False) -> dict:
    texts = long_prompts if tight else prompts
    max_tokens = draw(st.integers(1, 40 if tiny else 10))
    body = {"model": "tiny" if tiny else "smollm2-135m", "max_tokens": max_tokens, "n": draw(st.integers(1, 3))}
    if chat:
        messages = [{"role": "user", "content": draw(texts)}]
        if not tight and draw(st.booleans()):
            messages.insert(0, {"role": "system", "content": draw(texts)})
        body["messages"] = messages
    else:
        body["prompt"] = draw(
            st.one_of(
                texts,
                texts,
                st.lists(texts, min_size=2, max_size=2),
                st.lists(st.integers(0, 258 if tiny else 49151), min_size=1, max_size=6),
            )
        )
    if draw(st.booleans()):
        body["temperature"] = 0
    else:
        body["temperature"], body["seed"] = 0.7, draw(st.integers(0, 2**32))
    if chat:
        if draw(st.booleans()):
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 3))
    else:
        if draw(st.booleans()):
            body["logprobs"] = draw(st.integers(0, 3))
        if draw(st.integers(0, 2)) == 0:
            body["echo"] = True  # with logprobs, the prompt's tokens' too
    if draw(st.booleans()):
        body["skip_special_tokens"] = draw(st.booleans())
    if draw(st.integers(0, 2)) == 0:
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    if draw(st.booleans()):
        body["ignore_eos"] = True
    if tiny:
        if bias := draw(tiny_bias()):
            body["logit_bias"] = bias
        if draw(st.integers(0, 2)) == 0:
            body["stop_token_ids"] = draw(st.lists(st.sampled_from(TINY_IDS), max_size=2))
    elif draw(st.integers(0, 2)) == 0:
        body["stop_token_ids"] = draw(st.lists(st.sampled_from([30, 198, 28, 260, 2]), max_size=2))
    if draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return body


@st.composite
def stops_from(draw, texts: list[str]) -> list[str]:
    """1-4 stop strings: pieces of the reply made without them (so they cross token boundaries), a prefix
    of another, one that almost matches (its start held back, then let out), a long one, fixed fragments."""
    texts = [t for t in texts if t]

    def piece() -> str:
        t = draw(st.sampled_from(texts))
        a = draw(st.integers(0, len(t) - 1))
        return t[a : a + draw(st.integers(1, 12))]

    kinds = ["fragment", "random", "long"] + (["piece", "piece", "prefix", "almost"] if texts else [])
    stops: list[str] = []
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=4)):
        if kind == "fragment":
            stops.append(draw(st.sampled_from(FRAGMENTS)))
        elif kind == "random":
            stops.append(draw(st.text(min_size=1, max_size=4)))
        elif kind == "long":
            stops.append(draw(st.text(min_size=40, max_size=200)))
        elif kind == "piece":
            stops.append(piece())
        elif kind == "prefix":
            s = piece()
            stops += [s, s[: draw(st.integers(1, len(s)))]]
        else:  # the reply's own text, then a character it never has: held back until the end
            stops.append(piece() + draw(st.sampled_from(["\x00", "\u2603", "zq"])))
    return stops[:4]


def choice_texts(reply: dict, chat: bool) -> list[str]:
    return [c["message"]["content"] if chat else c["text"] for c in reply["choices"]]


def run_case(server, chat: bool, body: dict, data) -> None:
    """A reply without stop strings; then, stop strings drawn from it, the request unstreamed and streamed.
    Besides parity: each choice's text is a prefix of its stop-less text, holds no stop string, and is cut (if
    at all) where one begins."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    note(f"reference request: {json.dumps(body, ensure_ascii=False)}")
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    reference = whole(server, path, {**plain, "echo": None})
    full = choice_texts(reference, chat)
    stops = data.draw(stops_from(full), label="stop")
    if data.draw(st.booleans(), label="stop as a string") and len(stops) == 1:
        body = {**body, "stop": stops[0]}
    else:
        body = {**body, "stop": stops}
    reply = check_parity(
        server, chat, body, data.draw(st.sampled_from(["plain first", "stream first", "together"]), label="order")
    )
    tok, n = server.engine.tokenizer, body["n"]
    prompt = body.get("prompt")
    prompts_ = prompt if isinstance(prompt, list) and not all(type(t) is int for t in prompt) else [prompt]
    for i, (text, ref) in enumerate(zip(choice_texts(reply, chat), full)):
        if body.get("echo"):  # the prompt comes back first, as sent (token ids as their text)
            p = prompts_[i // n]
            echoed = tok.decode(p) if isinstance(p, list) else p
            assert text.startswith(echoed), (text, echoed)
            text = text[len(echoed) :]
        assert ref.startswith(text), (i, text, ref, stops)
        if not body.get("min_tokens"):  # before min_tokens, stop strings are let out (as in vLLM)
            assert not any(s in text for s in stops), (i, text, stops)
        if text != ref:  # cut where a stop string begins
            assert any(ref.startswith(s, len(text)) for s in stops), (i, text, ref, stops)


def parity_test(server: str, chat: bool, n: int, **kinds):
    """A test of run_case on the fixture named server, n examples of requests(chat, **kinds)."""

    @examples(n)
    @given(data=st.data())
    def test(request, data):
        run_case(request.getfixturevalue(server), chat, data.draw(requests(chat, **kinds), label="request"), data)

    return test


test_completions_tiny = pytest.mark.slow(parity_test("tiny_server", False, 10, tiny=True))
test_chat_tiny = parity_test("tiny_server", True, 10, tiny=True)
test_completions_tiny_preempted = parity_test("tight_server", False, 4, tiny=True, tight=True)
test_chat_tiny_preempted = parity_test("tight_server", True, 4, tiny=True, tight=True)
test_completions_smollm2 = pytest.mark.slow(parity_test("smol_server", False, 2, tiny=False))  # tiny: the inner loop
test_chat_smollm2 = pytest.mark.slow(parity_test("smol_server", True, 2, tiny=False))


def test_a_stop_string_completed_by_the_last_character_ends_the_reply(tiny_server):
    """A reply that ends inside a UTF-8 character ends with U+FFFD; a stop string that this completes is
    not let out, and the reply stops there. logit_bias makes the one token the byte C3 (é's first)."""
    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {"195": 5},
        "stop": ["\ufffd"],
    }
    reply = check_parity(tiny_server, False, body)
    assert (reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]) == ("", "stop")


def test_parity_through_preemption_and_chunked_prompts(tight_server):
    """The tight server's n=3 of 72-token prompts and 40 tokens each do not fit its pool at once: sequences are
    preempted and recomputed, their prompts cut into 32-token chunks, the two requests sharing steps."""
    before = tight_server.stats["num_preemptions"]
    body = {
        "model": "tiny",
        "prompt": "é😀 Paris, the\n" * 4,
        "n": 3,
        "max_tokens": 40,
        "temperature": 0.7,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    reply = check_parity(tight_server, False, body, "together")
    assert reply["usage"]["completion_tokens"] == 120
    assert tight_server.stats["num_preemptions"] > before
