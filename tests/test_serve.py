"""serve.py through HTTP: the official openai client (sync and async), SSE shape, usage, n, seeds, stop
strings, logprobs; 64 concurrent streams with disconnects; hostile inputs; continuous batching seen from
outside; the CLI. One in-process server on loopback serves most tests."""

import argparse
import asyncio
import collections
import http.client
import importlib
import importlib.metadata
import io
import json
import os
import queue
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields

import openai
import pytest
import torch

import weights
from cli import add_cli_args, from_cli_args
from config import EngineConfig
from conftest import serving, serving_tiny
from serve import Server, main, sampling_note
from tokenizer import read_chat_template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in the server fixture
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    # One intra-op thread: on a busy 2-core box torch's pool keeps waiting for descheduled workers, and
    # these tests (about HTTP, not speed) took several times longer with two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # max_num_seqs=16: 16-row matmul tiles (cpu.row_tile) instead of 64, for the few requests at a time here.
    s = Server(EngineConfig(num_kv_blocks=512, max_num_seqs=16, device="cpu", dtype="float32"), port=0)
    s.start()
    s.while_loading = [
        request(s, "GET", "/health")[0],
        request(s, "GET", "/v1/models")[0],
        request(s, "POST", "/v1/chat/completions", VALID)[0],
    ]
    assert s.wait_ready(300)
    yield s
    s.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def engine_drained(request):
    """Every test leaves no sequence running and no KV in use (aborts included)."""
    yield
    if "server" in request.fixturenames:
        server = request.getfixturevalue("server")
        m = wait_metrics(
            server,
            lambda m: m["num_requests_running"] == m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0,
        )
        assert m["kv_cache_usage_perc"] == 0 and m["num_requests_running"] == 0, m


def request(server, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, r.read()
    conn.close()
    return out


def metrics(server) -> dict[str, float]:
    status, text = request(server, "GET", "/metrics")
    assert status == 200
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^vllm:(\w+)\{model_name="[^"]+"\} (\S+)$', text.decode(), re.M)
    }


def wait_metrics(server, ok, timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not ok(m := metrics(server)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return m


def test_health_models_and_metrics(server):
    assert server.while_loading == [503, 503, 503]
    assert request(server, "GET", "/health")[0] == 200
    status, body = request(server, "GET", "/v1/models")
    assert (
        status == 200 and json.loads(body)["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )  # vLLM's first: the HF id
    text = request(server, "GET", "/metrics")[1].decode()
    for name in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
    ]:
        assert f"# TYPE vllm:{name} " in text
    assert '\nvllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="512"} 1\n' in text
    for name in ["time_to_first_token_seconds", "inter_token_latency_seconds"]:
        assert f"# TYPE vllm:{name} histogram" in text
        assert f'vllm:{name}_bucket{{model_name="HuggingFaceTB/SmolLM2-135M-Instruct",le="+Inf"}}' in text
    for name, top in [("time_to_first_token_seconds", 2560.0), ("e2e_request_latency_seconds", 7680.0)]:
        assert (
            f'vllm:{name}_bucket{{model_name="HuggingFaceTB/SmolLM2-135M-Instruct",le="{top}"}}' in text
        )  # vLLM's bounds


def test_a_connection_numbered_past_1024_is_served(server):
    """A server holding a thousand connections gets socket descriptors of 1024 and more, which select()
    cannot watch: such a request, streamed or not, is served like any other."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} files: no descriptor reaches 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:  # the server's next sockets come after these
            held.append(os.open(os.devnull, os.O_RDONLY))
        status, body = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200, body
        status, body = request(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stream": True})
        assert status == 200 and body.decode().endswith("data: [DONE]\n\n"), body
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_waiting_request_wakes_its_thread_once_a_second(monkeypatch):
    """A request waiting for a place in the batch wakes its handler thread about once a second: 600 waiting
    ones waking ten times a second each slowed the running streams by a quarter."""
    timeouts = []

    class Counted(queue.Queue):  # the handlers' reply queues: a get that times out is a wake-up for nothing
        def get(self, block=True, timeout=None):
            try:
                return super().get(block, timeout)
            except queue.Empty:
                if block and timeout is not None:
                    timeouts.append(time.monotonic())
                raise

    monkeypatch.setattr(queue, "Queue", Counted)
    with serving_tiny(max_num_seqs=1, log_requests=False) as s:
        running = http.client.HTTPConnection(s.host, s.port, timeout=60)
        running.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "a", "max_tokens": 8000, "stream": True, "ignore_eos": True}),
        )
        events = running.getresponse()
        events.readline()  # it runs: the next request waits
        waiting = threading.Thread(
            target=request, args=(s, "POST", "/v1/completions", {"prompt": "b", "max_tokens": 2})
        )
        waiting.start()
        assert wait_metrics(s, lambda m: m["num_requests_waiting"] == 1)["num_requests_waiting"] == 1
        began = time.monotonic()
        time.sleep(2.5)
        woke = [t for t in timeouts if t > began]
        running.close()  # the stream's request ends; the waiting one runs
        waiting.join(30)
        assert not waiting.is_alive()
    assert 1 <= len(woke) <= 4, woke


def test_chat(server, client):
    before = metrics(server)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt = server.engine.tokenizer.apply_chat_template(CHAT)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(choice.logprobs.content) <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    assert "".join(e.token for e in choice.logprobs.content).startswith(choice.message.content)
    after = metrics(server)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == r.usage.completion_tokens

    # The same request streamed: the same text, in OpenAI's chunk shapes, usage last.
    chunks = list(
        client.chat.completions.create(
            model="smollm2-135m",
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])

    # vLLM's continuous_usage_stats (guidellm always sends it): every chunk carries the usage so far; a false or null
    # key changes nothing.
    kwargs = dict(model="smollm2-135m", messages=CHAT, max_tokens=8, temperature=0, stream=True)
    options = {"include_usage": True, "continuous_usage_stats": True}
    counted = list(client.chat.completions.create(**kwargs, stream_options=options))
    made = [c.usage.completion_tokens for c in counted]
    assert made == sorted(made) and made[-1] == r.usage.completion_tokens and made[0] == 1  # with the first token
    assert all(c.usage.prompt_tokens == r.usage.prompt_tokens for c in counted)
    assert [c.model_dump(exclude={"usage", "created", "id"}) for c in counted[:-1]] == [
        c.model_dump(exclude={"usage", "created", "id"}) for c in chunks[:-1]
    ]
    for off in (False, None):
        quiet = list(
            client.chat.completions.create(
                **kwargs, stream_options={"include_usage": True, "continuous_usage_stats": off}
            )
        )
        assert all(c.usage is None for c in quiet[:-1])


def test_chat_content_parts_and_roles(client):
    parts = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
    ]
    alias = os.path.basename(weights.resolve_checkpoint())  # the checkpoint's file name names the model too
    r = client.chat.completions.create(model=alias, messages=parts, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3 and r.model == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_completions(server, client):
    tok = server.engine.tokenizer
    r = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    choice = r.choices[0]
    assert r.object == "text_completion" and choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tok.encode("The capital of France is"))
    assert r.usage.completion_tokens == len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
    # The sampled token's logprob is always among the top ones (OpenAI: up to logprobs + 1 entries).
    assert all(
        len(top) <= 3 and top[t] == lp
        for t, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)
    )
    assert choice.logprobs.text_offset[0] == 0
    # echo gives a text prompt back as sent, even one that does not survive tokenizing (\x04 has no token)
    assert tok.decode(tok.encode("a\x04b")) == "ab"
    r = client.completions.create(model="smollm2-135m", prompt="a\x04b", max_tokens=1, echo=True)
    assert r.choices[0].text.startswith("a\x04b")
    streamed = list(
        client.completions.create(
            model="smollm2-135m", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text

    # A list of prompts (text and token ids) times n: choices indexed prompt-major, prompts counted once.
    ids = tok.encode("Once upon a time")
    r = client.completions.create(
        model="smollm2-135m", prompt=["Hello", ids], n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(tok.encode("Hello")) + len(ids)
    assert r.usage.completion_tokens == 12
    r = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=2, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2


def test_streamed_text_offsets_are_the_whole_replys(client):
    """completions' text_offset streamed as in the whole reply, also while a stop string's start is held back."""
    args = dict(model="smollm2-135m", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[" 6, 7"], logprobs=0)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == whole.logprobs.text_offset


def test_n_and_seed(client):
    def run():
        return client.completions.create(
            model="smollm2-135m",
            prompt="Once upon a time",
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )

    a, b = run(), run()
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert texts[0] != texts[1]  # sequence i is seeded with seed + i
    assert a.usage.completion_tokens == 12


def test_chat_n2_stream(client):
    chunks = list(
        client.chat.completions.create(model="smollm2-135m", messages=CHAT, n=2, max_tokens=4, seed=5, stream=True)
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_stop_strings(client):
    full = (
        client.completions.create(
            model="smollm2-135m",
            prompt="List three colors:",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    head = full[: full.index(stop)]
    r = client.completions.create(
        model="smollm2-135m", prompt="List three colors:", max_tokens=12, temperature=0, stop=[stop, "never appears"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].stop_reason) == (head, "stop", stop)
    streamed = list(
        client.completions.create(
            model="smollm2-135m", prompt="List three colors:", max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == head
    assert [c.choices[0].stop_reason for c in streamed] == [None] * (len(streamed) - 1) + [stop]
    # vLLM's stop_reason: the stop string or stop token id that ended a reply; None for EOS or the length.
    assert (
        client.completions.create(model="smollm2-135m", prompt="List three colors:", max_tokens=2, temperature=0)
        .choices[0]
        .stop_reason
        is None
    )


def test_penalties_and_sampling_knobs(client):
    r = client.chat.completions.create(
        model="smollm2-135m",
        messages=CHAT,
        max_tokens=4,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        top_p=0.9,
        seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 2, "logit_bias": {"11": 5}},
    )
    assert 2 <= r.usage.completion_tokens <= 4
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=4, presence_penalty=3)
    assert e.value.body["param"] == "presence_penalty"


def test_async_client(server):
    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        plain = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=4, temperature=0)
        stream = await client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=4, stream=True)
        text = "".join([c.choices[0].text async for c in stream])
        r = await plain
        await client.close()
        return r, text

    r, text = asyncio.run(go())
    assert r.choices[0].message.content and text


def test_non_streaming_disconnect_aborts(server):
    body = json.dumps({"model": "smollm2-135m", "prompt": "Count:", "max_tokens": 4000, "ignore_eos": True}).encode()
    sock = socket.create_connection((server.host, server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert wait_metrics(server, lambda m: m["kv_cache_usage_perc"] > 0)["num_requests_running"] == 1
    sock.close()
    m = wait_metrics(server, lambda m: m["num_requests_running"] == 0, timeout=10)
    assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_short_requests_finish_before_long_one(server, client):
    """Continuous batching seen through HTTP: short requests sent while a long one runs finish first."""
    finished: dict[str, float] = {}
    long_started = threading.Event()

    def long():
        stream = client.completions.create(
            model="smollm2-135m",
            prompt="Write a long story:",
            max_tokens=24,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            long_started.set()
        finished["long"] = time.monotonic()

    def short(i: int):
        client.completions.create(model="smollm2-135m", prompt=f"Hi {i}", max_tokens=2, extra_body={"ignore_eos": True})
        finished[f"short{i}"] = time.monotonic()

    threads = [threading.Thread(target=long)]
    threads[0].start()
    assert long_started.wait(60)
    threads += [threading.Thread(target=short, args=(i,)) for i in range(4)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert len(finished) == 5
    assert max(v for k, v in finished.items() if k != "long") < finished["long"]


VALID = {"model": "smollm2-135m", "messages": CHAT, "max_tokens": 2}


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        (b'{"model": "\xff\xfe"}', 400, None),  # invalid UTF-8
        (b"[1, 2]", 400, None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
        (b"[" * 100000 + b"]" * 100000, 400, None),
        ({**VALID, "max_tokens": "8"}, 400, "max_tokens"),
        ({**VALID, "max_tokens": -1}, 400, "max_tokens"),
        ({**VALID, "max_tokens": 10**12}, 400, "max_tokens"),
        ({**VALID, "temperature": "hot"}, 400, "temperature"),
        ({**VALID, "temperature": -1}, 400, "temperature"),
        ({**VALID, "stream": "yes"}, 400, "stream"),
        ({**VALID, "n": 0}, 400, "n"),
        ({**VALID, "stop": [1]}, 400, "stop"),
        ({**VALID, "stop": ""}, 400, "stop"),
        ({**VALID, "stop": ["done", ""]}, 400, "stop"),
        ({**VALID, "stop": ["x" * 10000]}, 400, "stop"),
        ({**VALID, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
        ({**VALID, "top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
        ({**VALID, "user": 5}, 400, "user"),
        ({**VALID, "stream_options": {"include_usage": True}}, 400, "stream_options"),  # not streamed
        ({**VALID, "stream": True, "stream_options": "x"}, 400, "stream_options"),
        ({**VALID, "stream": True, "stream_options": {"include_usage": True, "usage_every": 2}}, 400, "stream_options"),
        ({**VALID, "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
        ({**VALID, "logit_bias": {"49152": 1}}, 400, "logit_bias"),  # past the vocabulary
        ({**VALID, "stop_token_ids": [49152]}, 400, "stop_token_ids"),
        ({**VALID, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({**VALID, "messages": []}, 400, "messages"),
        ({**VALID, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ({**VALID, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
        ({**VALID, "messages": "hi"}, 400, "messages"),
        ({**VALID, "model": "gpt-4"}, 404, "model"),
        ({**VALID, "model": 7}, 400, "model"),
    ],
)
def test_bad_chat_requests(server, body, status, param):
    got, raw = request(server, "POST", "/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert got == status, error
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param


@pytest.mark.parametrize("prompt", ["", [], [[]], [10**9], [1, "a"], {"a": 1}, None, [-1]])
def test_bad_prompts(server, prompt):
    got, raw = request(server, "POST", "/v1/completions", {"model": "smollm2-135m", "prompt": prompt})
    error = json.loads(raw)["error"]
    assert got == 400 and error["message"] and error["param"] == "prompt", error


def test_seeds_out_of_range_and_max_tokens_beside_max_completion_tokens_are_400s(server):
    # A seed past 64 bits is refused, not wrapped onto another; max_tokens is checked even where
    # max_completion_tokens decides.
    for body, param in [
        ({"prompt": "x", "max_tokens": 1, "seed": 2**64}, "seed"),
        ({"prompt": "x", "max_tokens": 1, "seed": -(2**63) - 1}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1, "max_tokens": "a"}, "max_tokens"),
    ]:
        status, raw = request(server, "POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
        assert (status, json.loads(raw)["error"]["param"]) == (400, param), raw
    for seed in (-(2**63), 2**64 - 1):
        assert request(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1, "seed": seed})[0] == 200


def test_routes_sizes_and_context(server):
    assert request(server, "GET", "/v1/nothing")[0] == 404
    assert request(server, "POST", "/v1/chat/completions/x", b"{}")[0] == 404
    status, raw = request(server, "POST", "/v1/chat/completions", b"x", {"Content-Length": str(10**10)})
    assert status == 413 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    # Context overflows in vLLM's words with OpenAI's code, which clients match to shorten and retry.
    for body, param in [
        ({"prompt": "hello " * 9000, "max_tokens": 1}, "prompt"),
        ({"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
        ({"prompt": "hello " * 100, "max_tokens": 8100}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8190}, "max_completion_tokens"),
    ]:
        status, raw = request(server, "POST", "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["param"]) == (400, "context_length_exceeded", param), error
        assert "maximum context length is 8192 tokens" in error["message"]


def raw_exchange(server, data: bytes, shut: bool = False) -> tuple[int, dict]:
    """data sent on a socket of its own (shut: then its sending side closed); the status and JSON body."""
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_http_layer_refusals_come_as_openai_json(server):
    for data, status in [
        (b"GET http://[/health HTTP/1.1\r\nConnection: close\r\n\r\n", 400),  # urlsplit fails
        (b"GARBAGE\r\n\r\n", 400),
        (b"BREW /health HTTP/1.1\r\n\r\n", 501),
        (b"PUT /v1/models HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        # A line with no colon: the headers after it were dropped, so this body passed for a second request.
        (b"GET /health HTTP/1.1\r\nNoColon\r\nContent-Length: 25\r\n\r\nGET /version HTTP/1.1\r\n\r\n", 400),
    ]:
        got, body = raw_exchange(server, data)
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, (data, body)
    for method, path, allow in (("DELETE", "/v1/models", "GET, HEAD"), ("GET", "/v1/completions", "POST")):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request(method, path)
        reply = conn.getresponse()
        assert (reply.status, reply.getheader("Allow")) == (405, allow) and json.loads(reply.read())["error"]
        conn.close()
    # A body cut short by a half-close is refused as such, not parsed as it stands.
    got, body = raw_exchange(server, b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{}", shut=True)
    assert got == 400 and "2 of its 100 bytes" in body["error"]["message"]
    for head, status in [(b"Transfer-Encoding: gzip", 501), (b"Transfer-Encoding: chunked\r\nContent-Length: 2", 400)]:
        assert raw_exchange(server, b"POST /tokenize HTTP/1.1\r\n%s\r\n\r\n{}" % head, shut=True)[0] == status
    chunked = b"POST /tokenize HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    got, body = raw_exchange(server, chunked + b"zz\r\n", shut=True)
    assert got == 400 and "chunk size" in body["error"]["message"]
    # A body sent in chunks (a client streaming its upload) is read whole, extensions and trailers skipped,
    # and the connection goes on to the next request.
    data = json.dumps({"prompt": "Hello there"}).encode()
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        pieces = b"5;x=y\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (data[:5], len(data) - 5, data[5:])
        s.sendall(chunked + pieces + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    first, second = reply.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200") and second.startswith(b"200"), reply
    assert json.loads(first.partition(b"\r\n\r\n")[2])["count"] >= 2
    # A client that writes all of its oversized body before reading gets the 413, not a reset.
    status, raw = request(server, "POST", "/v1/completions", b"x" * (9 << 20))
    assert status == 413 and json.loads(raw)["error"]["message"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("HEAD", "/health")
    r = conn.getresponse()
    assert r.status == 200 and int(r.headers["Content-Length"]) > 0 and r.read() == b""
    conn.request("GET", "/health")  # the same connection: HEAD left no body behind
    assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    conn.close()


def test_no_body_passes_for_the_next_request_and_http10_streams_unchunked(server, capsys):
    def exchange(data: bytes) -> bytes:
        with socket.create_connection((server.host, server.port), timeout=30) as s:
            s.sendall(data)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        return reply

    # A GET's body (here a request of its own) stays unread, and the connection closes after the answer.
    inner = b"GET /version HTTP/1.1\r\n\r\n"
    reply = exchange(b"GET /health HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(inner), inner))
    assert reply.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in reply and b"version" not in reply, reply
    reply = exchange(
        b"GET /health HTTP/1.1\r\nContent-Length: 0\r\n\r\nGET /version HTTP/1.1\r\nConnection: close\r\n\r\n"
    )  # an empty body is no body: the connection goes on
    assert reply.count(b"HTTP/1.1 200") == 2 and b"version" in reply, reply
    # Two Content-Lengths: neither frames the body, the request is refused and the connection closed.
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    reply = exchange(
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1 ") == 1 and b"conflicting" in reply, reply
    # HTTP/1.0 has no chunked coding: a stream comes as it is, ended by the connection's close.
    body = json.dumps({"prompt": "Hi", "max_tokens": 2, "stream": True}).encode()
    head, _, events = exchange(
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    ).partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower() and events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n")
    assert all(e.startswith(b"data: ") for e in events.split(b"\n\n")[:-1]), events
    # Expect: 100-continue for a body over the limit: the 413 at once, no 100 Continue to send it after.
    reply = exchange(b"POST /v1/completions HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 999999999\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"100 Continue" not in reply and b"over" in reply, reply
    # An HTTP/1.0 client that asks to keep the connection is told it is kept (it would assume a close otherwise).
    reply = exchange(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /version HTTP/1.0\r\n\r\n")
    assert reply.count(b"HTTP/1.1 200") == 2 and reply.count(b"Connection: keep-alive") == 1, reply
    # A client that sends a bad request and leaves before the answer is routine; a bug still shows.
    for error in (BrokenPipeError(), ValueError("a bug")):
        try:
            raise error
        except Exception:
            server._httpd.handle_error(None, ("127.0.0.1", 1))
    err = capsys.readouterr().err
    assert "ValueError: a bug" in err and "BrokenPipeError" not in err


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_slow_client_gets_408_and_others_are_served(server, client):
    saved, server.timeout = server.timeout, 1.5
    try:
        slow = socket.create_connection((server.host, server.port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        slow.settimeout(10)
        reply = b""
        while chunk := slow.recv(4096):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b'"error"' in reply
    finally:
        server.timeout = saved


def test_api_key(server):
    server.api_key = "sekret"
    try:
        assert request(server, "GET", "/v1/models")[0] == 401
        status, raw = request(server, "POST", "/v1/chat/completions", VALID, {"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
        assert request(server, "GET", "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
        assert request(server, "GET", "/health")[0] == 200
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert c.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=1).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    finally:
        server.api_key = None


def test_queue_limit_429_and_a_request_too_big_for_the_queue(server, client, monkeypatch):
    stats = server.engine.stats
    monkeypatch.setattr(server.config, "max_num_seqs", 4)  # the server's accounting only: the engine has its own
    full = {"num_running": 4, "num_waiting": 1}  # the batch is full and one request waits
    monkeypatch.setattr(server.engine, "stats", lambda: {**stats(), **full})
    monkeypatch.setattr(server, "max_queue", 2)
    with pytest.raises(openai.RateLimitError):  # 1 + 2 waiting would be over 2: come back later
        client.completions.create(model="smollm2-135m", prompt="Hi", n=2, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max-queue"):  # 7 never fit in 4 + 2: no point retrying
        client.completions.create(model="smollm2-135m", prompt="Hi", n=7, max_tokens=1)
    full["num_running"] = 2  # two free places in the batch: of the three sequences only one waits
    client.completions.create(model="smollm2-135m", prompt="Hi", n=2, max_tokens=1)
    full["num_swapped"] = 1  # but none is admitted while one is swapped out: 1 + 1 + 2 wait
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="smollm2-135m", prompt="Hi", n=2, max_tokens=1)
    monkeypatch.undo()
    client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=1)  # /metrics shows the truth again


def test_cli_bad_values_one_line(capsys):
    for argv in (
        ["--port", "-1"],
        ["--block-size", "x"],
        ["--preemption-mode", "never"],
        ["--gpu-memory-utilization", "1.5"],
        ["--request-timeout", "0"],
        ["--torch-threads", "100000"],
        ["--kv-cache-memory", "inf"],
        ["--max-model-len", "1"],
        ["--dummy-weights", "--model-path", "x.gguf"],
        ["--device", "cuda:abc"],
        ["--served-model-name", ""],
        ["--served-model-name", "a", ""],
        ["--allowed-origins", "example.com"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code != 0 and err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--enable-prefix-caching" in capsys.readouterr().out


@pytest.mark.parametrize("prog", ["serve", "bench"])
def test_every_engine_knob_is_a_flag(prog, capsys):
    # One source: both command lines are built from EngineConfig's fields, and a flag reaches the config.
    module = importlib.import_module(prog)
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    out = capsys.readouterr().out
    knobs = [f.name for f in fields(EngineConfig) if "help" in f.metadata]
    assert e.value.code == 0 and len(knobs) >= 20
    assert [k for k in knobs if f"--{k.replace('_', '-')}" not in out] == []
    argv = ["--swap-space", "1.5", "--no-enable-chunked-prefill", "--scheduling", "static", "--torch-threads", "1"]
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = from_cli_args(parser.parse_args(argv))
    assert (config.swap_space, config.enable_chunked_prefill, config.scheduling, config.torch_threads) == (
        1.5,
        False,
        "static",
        1,
    )
    assert from_cli_args(parser.parse_args([])) == EngineConfig()


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_cli_unknown_model_fails_cleanly():
    p = subprocess.run(
        [sys.executable, "serve.py", "--model", "no-such-model", "--port", "0"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "no-such-model" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_cli_port_taken_names_the_flag_to_change():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "serve.py", "--dummy-weights", "--port", str(port)],
            cwd=ROOT,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert (
        last.startswith(f"serve.py: error: cannot listen on 127.0.0.1:{port}: ")
        and f"--port {port + 1}, or --port 0 for any free port" in last
    ), last


def test_cli_takes_vllms_underscore_spellings():
    from serve import _parser

    args = _parser().parse_args(
        [
            "--max_num_seqs",
            "8",
            "--served_model_name",
            "my_model",
            "x",
            "--no_enable_chunked_prefill",
            "--request_timeout=2.5",
            "--chat-template",
            "a_b.jinja",
        ]
    )
    assert (
        args.max_num_seqs,
        args.served_model_name,
        args.enable_chunked_prefill,
        args.request_timeout,
        args.chat_template,
    ) == (8, ["my_model", "x"], False, 2.5, "a_b.jinja")  # values keep their underscores


def test_cli_takes_vllms_habits(capsys, monkeypatch):
    """`serve.py MODEL` as `vllm serve MODEL`, --dtype half and float, --trust-remote-code (a no-op, said so),
    --disable-log-stats, and the presets listed in --help; a model given twice, differently, is refused."""
    import serve

    p = serve._parser()
    args = p.parse_args(["HuggingFaceTB/SmolLM2-135M-Instruct", "--dtype", "half", "--disable-log-stats"])
    assert (args.model_tag, args.dtype, args.disable_log_stats) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "float16",
        True,
    )
    assert p.parse_args(["--dtype=half"]).dtype == "float16" and p.parse_args(["--dtype", "float"]).dtype == "float32"
    assert p.parse_args(["--served-model-name", "half"]).served_model_name == ["half"]  # only --dtype's values
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    assert "presets for --model: smollm2-135m, llama3-8b" in capsys.readouterr().out.replace("\n", " ")
    with pytest.raises(SystemExit):
        p.parse_args(["--version"])
    assert capsys.readouterr().out == f"laneserve {serve.version()}\n"
    monkeypatch.setattr(serve, "Server", lambda config, *a, **k: (_ for _ in ()).throw(RuntimeError(config.model)))
    with pytest.raises(RuntimeError, match="HuggingFaceTB/SmolLM2-135M-Instruct"):
        serve.main(["HuggingFaceTB/SmolLM2-135M-Instruct", "--trust-remote-code"])
    assert "--trust-remote-code changes nothing" in capsys.readouterr().err
    for argv in (["llama3-8b", "--model", "qwen3-0.6b"], ["qwen3-0.6b", "--model", "smollm2-135m"]):  # the default too
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        assert e.value.code == 2 and "the model is given twice" in capsys.readouterr().err


def test_a_preset_is_found_by_its_hugging_face_id():
    import weights

    assert weights.resolve_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct") == weights.resolve_checkpoint()


@pytest.mark.slow
def test_cli_refuses_a_pool_that_cannot_hold_one_full_request():
    """As vLLM: a KV pool smaller than one max_model_len request is an error at start, naming what to lower."""
    args = ["--dummy-weights", "--port", "0", "--num-kv-blocks", "4", "--max-model-len", "128"]
    r = subprocess.run(
        [sys.executable, "serve.py", *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "holds 64 tokens, less than one request of the full 128-token context: lower --max-model-len" in r.stderr


@pytest.mark.slow
def test_cli_serves_and_stops_on_sigterm():
    p = subprocess.Popen(
        [
            sys.executable,
            "serve.py",
            "--dummy-weights",
            "--port",
            "0",
            "--num-kv-blocks",
            "320",
            "--max-model-len",
            "4096",
            "--kv-cache-dtype",
            "int8",
        ],
        cwd=ROOT,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in p.stderr:
            lines.append(line)
            if "serving http" in line:
                break
        summary = lines[-1]
        assert "KV 320 blocks = 5120 tokens (int8)" in summary and " on cpu " in summary, lines
        assert "room for 1 request of the full 4096-token context" in summary, summary  # 5120 // 4096
        choices, note = p.stderr.readline(), p.stderr.readline()  # what runs on this CPU and why; sampling defaults
        assert choices.startswith("laneserve: CPU matmul kernels ") and "; weights as " in choices, choices
        # random weights: no generation_config.json, no model card
        assert "get OpenAI's defaults (temperature 1, top_p 1)" in note, note
        host, port = re.search(r"http://([\d.]+):(\d+)", summary).groups()
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        assert '\nvllm:cache_config_info{block_size="16",cache_dtype="int8",num_gpu_blocks="320"} 1\n' in text, text
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}))
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] >= 1
        # A stream still running does not hold up the stop (too long to end before it, on any machine).
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps({"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}),
        )
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        # Nor do 400 more requests, waiting or being read in: each still gets its whole answer, a 503 (in
        # the stream, for one streamed), before the process ends.
        answers, sent = [], threading.Semaphore(0)

        def send(stream: bool) -> None:
            c = http.client.HTTPConnection(host, int(port), timeout=60)
            try:
                c.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 400, "stream": stream}))
                sent.release()
                got = c.getresponse()
                body = got.read()
                answers.append((got.status, not stream or got.status != 200 or body.endswith(b"data: [DONE]\n\n")))
            except (OSError, http.client.HTTPException) as e:  # a connection reset, or an answer cut short
                answers.append((type(e).__name__, False))

        clients = [threading.Thread(target=send, args=(i % 2 == 0,)) for i in range(400)]
        for c in clients:
            c.start()
        for _ in clients:  # every request on its way: being read, or in the listener's backlog
            assert sent.acquire(timeout=60)
        p.send_signal(signal.SIGTERM)
        rest = r.read()
        assert b'"error"' in rest and rest.endswith(b"data: [DONE]\n\n"), (rest.count(b"data:"), rest[-300:])
        assert p.wait(30) == 0
        for c in clients:
            c.join(30)
        assert len(answers) == 400 and all(status in (200, 503) and whole for status, whole in answers), (
            collections.Counter(answers)
        )
        assert "Traceback" not in p.stderr.read()
    finally:
        p.kill()


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_cli_stops_cleanly_while_loading():
    p = subprocess.Popen(
        [sys.executable, "serve.py", "--port", "0"], cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True
    )
    assert "loading" in p.stderr.readline()
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 0
    err = p.stderr.read()
    assert "Traceback" not in err and "terminate" not in err, err


def test_tokenize_detokenize_version(server):
    status, body = request(server, "POST", "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(body)
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 8192
    assert (
        json.loads(request(server, "POST", "/detokenize", {"tokens": tokens["tokens"]})[1])["prompt"] == "Hello world"
    )
    chat = json.loads(request(server, "POST", "/tokenize", {"messages": CHAT})[1])
    engine = server.engine
    assert chat["tokens"] == engine.tokenizer.apply_chat_template(CHAT)
    bare = json.loads(request(server, "POST", "/tokenize", {"messages": CHAT, "add_generation_prompt": False})[1])
    assert bare["tokens"] == engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) != chat["tokens"]
    for path, body in [
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {}),
        ("/tokenize", b"[1]"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}),  # which one it tokenized would be a guess
    ]:
        status, reply = request(server, "POST", path, body)
        assert status == 400 and json.loads(reply)["error"]["type"] == "invalid_request_error", (path, reply)
    for path, body in [
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}),
        ("/detokenize", {"tokens": [1], "model": "x"}),
    ]:
        status, reply = request(server, "POST", path, body)
        assert status == 404 and json.loads(reply)["error"]["code"] == "model_not_found", (path, reply)
    assert request(server, "POST", "/tokenize", {"prompt": "x", "model": "smollm2-135m"})[0] == 200
    status, body = request(server, "GET", "/version")
    try:
        installed = importlib.metadata.version("laneserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout run in place, as on the GPU machine
        installed = "unknown"
    assert status == 200 and json.loads(body)["version"] == installed


def test_an_ipv6_host(tiny):
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    s = Server(EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"), host="::1", port=0)
    s.start()
    try:
        assert s.wait_ready(120) and s.url.startswith("http://[::1]:")
        assert request(s, "GET", "/health")[0] == 200
    finally:
        s.stop()


def test_served_model_name(tiny):
    # As vLLM's --served-model-name: these names only, the first in replies.
    s = Server(
        EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"),
        port=0,
        served_model_name=["my-model", "org/my-model"],
    )
    s.start()
    try:
        assert s.wait_ready(120)
        assert [m["id"] for m in json.loads(request(s, "GET", "/v1/models")[1])["data"]] == ["my-model", "org/my-model"]
        ok = {"model": "org/my-model", "prompt": [1, 2, 3], "max_tokens": 2}
        status, body = request(s, "POST", "/v1/completions", ok)
        assert status == 200 and json.loads(body)["model"] == "my-model"
        assert request(s, "POST", "/v1/completions", {**ok, "model": tiny})[0] == 404
    finally:
        s.stop()


def test_the_model_answers_to_its_preset_name_and_hugging_face_id(server, client):
    """vLLM serves a checkpoint under its Hugging Face id: a client written for it works unchanged. A wrong name's
    404 lists the names served, which /v1/models lists too, the one replies carry first."""
    hf = "HuggingFaceTB/SmolLM2-135M-Instruct"
    names = [m["id"] for m in json.loads(request(server, "GET", "/v1/models")[1])["data"]]
    assert names == [hf, "smollm2-135m", os.path.basename(server.engine.checkpoint_path)], names
    for name in names:
        r = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert r.model == hf
    for path, body in [
        ("/v1/chat/completions", {"model": "smollm2-135", "messages": CHAT, "max_tokens": 1}),
        ("/v1/completions", {"model": "SmolLM2-135M", "prompt": "Hi", "max_tokens": 1}),
    ]:
        status, raw = request(server, "POST", path, body)
        error = json.loads(raw)["error"]
        assert status == 404 and error["code"] == "model_not_found" and f"`{body['model']}`" in error["message"], error
        assert all(name in error["message"] for name in names), error


@pytest.mark.parametrize(
    "model, checkpoint, served, names",
    [
        ("smollm2-135m", None, None, ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"]),
        (
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            "/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0123abc",
            None,
            ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m", "SmolLM2-135M-Instruct"],
        ),  # not the hash
        (
            "llama3.1-8b",
            "/m/Llama-3.1-8B-Instruct-Q4_K_M.gguf",
            None,
            [
                "meta-llama/Llama-3.1-8B-Instruct",
                "llama3.1-8b",
                "meta-llama/Meta-Llama-3.1-8B-Instruct",
                "Llama-3.1-8B-Instruct-Q4_K_M.gguf",
            ],
        ),
        ("/models/my-llama/", "/models/my-llama", None, ["/models/my-llama/", "my-llama"]),
        ("smollm2-135m", "/m/x.gguf", "mine", ["mine"]),
    ],
)
def test_model_names(model, checkpoint, served, names):
    from server.openai_api import model_names

    assert model_names(model, checkpoint, served) == names


def test_wrong_routes_and_endpoints_name_the_right_one(tiny_server):
    """A client's base_url without /v1, and a prompt sent for a chat (or messages for a completion), get the
    route to use in OpenAI's error JSON."""
    for method, path, near in [
        ("POST", "/chat/completions", "/v1/chat/completions"),
        ("GET", "/models", "/v1/models"),
        ("POST", "/completions", "/v1/completions"),
        ("GET", "/v1/health", "/health"),
        ("GET", "/v1/v1/models", "/v1/models"),
    ]:
        status, raw = request(tiny_server, method, path, {"prompt": "x"} if method == "POST" else None)
        error = json.loads(raw)["error"]
        assert status == 404 and f"did you mean {near}?" in error["message"], (path, error)
        assert ("base_url ends in /v1" in error["message"]) == near.startswith("/v1/"), error
    assert "did you mean" not in json.loads(request(tiny_server, "GET", "/nowhere")[1])["error"]["message"]
    for path, body, right in [
        ("/v1/chat/completions", {"prompt": "Hi"}, "/v1/completions"),
        ("/v1/completions", {"messages": CHAT}, "/v1/chat/completions"),
    ]:
        status, raw = request(tiny_server, "POST", path, {**body, "max_tokens": 1})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == next(iter(body)) and right in error["message"], error
        assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_field", error


class Killed(BaseException):
    pass


@pytest.mark.parametrize("where", ["step", "stats"])
def test_engine_thread_death_is_reported_not_hung(tiny, capsys, where):
    # Death mid-step with the request in flight, or while taking the request from the inbox (stats are read
    # there, outside any step): either way every request gets OpenAI's error at once, and so does /health.
    s = Server(EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"), port=0)
    s.start()
    try:
        assert s.wait_ready(120)
        body = {"model": tiny, "prompt": [1, 2, 3], "max_tokens": 50, "ignore_eos": True}

        def broken():
            raise Killed("injected") if where == "step" else RuntimeError("injected")

        setattr(s.engine, where, broken)
        began = time.monotonic()
        status, reply = request(s, "POST", "/v1/completions", body)
        assert status == 503 and "engine thread died" in json.loads(reply)["error"]["message"]
        status, reply = request(s, "GET", "/health")
        assert status == 503 and "injected" in json.loads(reply)["error"]["message"]
        assert request(s, "POST", "/v1/completions", body)[0] == 503
        assert time.monotonic() - began < 5
        assert re.search(r"^laneserve:engine_alive\{.*\} 0$", request(s, "GET", "/metrics")[1].decode(), re.M)
        assert "injected" in capsys.readouterr().err  # the traceback is in the server's log
    finally:
        s.stop()


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_request_timeout_ends_the_request_and_frees_its_lane(tiny):
    s = Server(
        EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"), port=0, request_timeout=0.5
    )
    s.start()
    try:
        assert s.wait_ready(120)
        step = s.engine.step
        s.engine.step = lambda: time.sleep(0.05) or step()  # 200 tokens now take 10 s
        body = {"model": tiny, "prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
        began = time.monotonic()
        conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        status, reply = r.status, r.read()
        assert status == 408 and "--request-timeout 0.5s" in json.loads(reply)["error"]["message"]
        assert r.getheader("x-should-retry") == "false"  # or openai's client sends it twice more
        assert time.monotonic() - began < 2
        m = wait_metrics(s, lambda m: m["kv_cache_usage_perc"] == 0 and m["num_requests_running"] == 0)
        assert m["kv_cache_usage_perc"] == 0 and m["num_requests_running"] == 0
        # Streamed, the status line is out before the time is up: the error comes as an event, and the
        # access log names it beside the 200.
        s.log = log = io.StringIO()
        conn.request(
            "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        events = conn.getresponse().read().decode()
        assert "--request-timeout 0.5s" in events and events.endswith("data: [DONE]\n\n"), events
        deadline = time.monotonic() + 5  # the line is written once the response is out
        while '"POST' not in log.getvalue() and time.monotonic() < deadline:  # a /metrics poll's may come first
            time.sleep(0.01)
        line = r'^127\.0\.0\.1 "POST /v1/completions" 200( ttft=\S+)? error=408 duration='
        assert re.search(line, log.getvalue(), re.M), log.getvalue()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server():
    with serving_tiny(num_kv_blocks=256, enable_prefix_caching=True, max_model_len=256) as s:
        yield s


@pytest.fixture
def tiny_client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_unsupported_fields_are_refused_by_name(tiny_server, tiny_client):
    for body, param in [
        ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": CHAT, "echo": True}, "echo"),  # a completions field
        ({"prompt": "x", "suffix": "y", "best_of": 2}, "best_of"),
        ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM
    ]:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, raw = request(tiny_server, "POST", path, {"model": "tiny", "max_tokens": 2, **body})
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and param in error["message"], error
    status, raw = request(tiny_server, "POST", "/tokenize", {"prompt": "x", "add_bos": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "add_bos"
    # null means absent, and the fields OpenAI's client sends are all taken
    r = tiny_client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=2,
        user="u1",
        tools=None,
        response_format={"type": "text"},
        stream_options=None,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert (
        request(
            tiny_server,
            "POST",
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 1, "response_format": {"type": None}},
        )[0]
        == 200
    )


def test_a_tiny_temperature_samples_at_a_hundredth(tiny_client):
    """Logits divided by 1e-38 overflow float32: below 0.01 a temperature is taken as 0.01, as in vLLM."""
    args = dict(model="tiny", prompt="Tiny", max_tokens=8, extra_body={"ignore_eos": True})
    for temperature, seed in [(1e-38, 0), (1e-38, 1), (5e-6, 2)]:
        r = tiny_client.completions.create(**args, temperature=temperature, seed=seed).choices[0]
        assert r.finish_reason == "length"
        assert r.text == tiny_client.completions.create(**args, temperature=0.01, seed=seed).choices[0].text


def test_echo_stop_token_ids_and_cached_tokens(tiny_server, tiny_client):
    r = tiny_client.completions.create(
        model="tiny", prompt="Echo me", max_tokens=3, temperature=0, echo=True, extra_body={"ignore_eos": True}
    )
    plain = tiny_client.completions.create(
        model="tiny", prompt="Echo me", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    chunks = tiny_client.completions.create(
        model="tiny",
        prompt="Echo me",
        max_tokens=3,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    stop = tiny_client.completions.create(
        model="tiny",
        prompt="Echo me",
        max_tokens=3,
        temperature=0,
        logit_bias={"300": 100},
        extra_body={"stop_token_ids": [300]},
    )
    assert stop.choices[0].finish_reason == "stop" and stop.usage.completion_tokens == 1
    # <|im_start|> (id 257 here) made certain: no text by default, its text when asked.
    texts = [
        tiny_client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=2, logit_bias={"257": 100}, extra_body=extra
        )
        .choices[0]
        .message.content
        for extra in ({}, {"skip_special_tokens": False})
    ]
    assert texts == ["", "<|im_start|><|im_start|>"]
    system = [{"role": "system", "content": "You answer in one word. " * 8}]
    usage = [
        tiny_client.chat.completions.create(
            model="tiny", messages=system + [{"role": "user", "content": q}], max_tokens=2
        ).usage
        for q in ("Why?", "How?")
    ]
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert usage[1].prompt_tokens_details.cached_tokens >= 64  # whole blocks of the shared system prompt


def test_cache_salt(tiny_server, tiny_client):
    system = [{"role": "system", "content": "Salted prefix, shared by salt only. " * 6}]

    def cached(question: str, salt: str | None) -> int:
        return tiny_client.chat.completions.create(
            model="tiny",
            messages=system + [{"role": "user", "content": question}],
            max_tokens=2,
            extra_body={"cache_salt": salt},
        ).usage.prompt_tokens_details.cached_tokens

    got = [cached("Who?", "a"), cached("What?", "b"), cached("When?", None), cached("Where?", "a"), cached("Why?", "b")]
    assert got[:3] == [0, 0, 0] and min(got[3:]) >= 64  # whole blocks of the system prompt, only for its salt
    for salt, what in [("", "a non-empty string"), (7, "a string")]:
        with pytest.raises(openai.BadRequestError) as e:
            tiny_client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"cache_salt": salt})
        assert e.value.body["param"] == "cache_salt" and what in e.value.body["message"]


def test_access_log_and_request_histograms(tiny_server, tiny_client):
    tiny_server.log = log = io.StringIO()
    try:
        tiny_client.completions.create(model="tiny", prompt="Log me", max_tokens=3, extra_body={"ignore_eos": True})
        request(tiny_server, "GET", "/nothing")
        deadline = time.monotonic() + 5  # a line is written once its response is out
        while log.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tiny_server.log = sys.stderr
    lines = log.getvalue().splitlines()
    assert re.fullmatch(
        r'127\.0\.0\.1 "POST /v1/completions" 200 ttft=\d+\.\d{3}s prompt=6 output=3 '
        r"duration=\d+\.\d{3}s",
        lines[0],
    ), lines
    assert lines[1].startswith('127.0.0.1 "GET /nothing" 404 duration=')
    text = request(tiny_server, "GET", "/metrics")[1].decode()
    for name in ("request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert f"# TYPE vllm:{name} histogram" in text
        assert float(re.search(rf"^vllm:{name}_count\S* (\S+)$", text, re.M).group(1)) >= 1


def test_access_log_says_499_for_a_client_gone_before_its_answer(tiny_server):
    tiny_server.log = log = io.StringIO()
    try:
        # An answer that takes a few of the server's looks at the socket (one each 0.1 s), so that one comes after
        # the client's close on any machine: 16 choices of 240 tokens with logprobs (the tiny model is quick).
        body = json.dumps(
            {"model": "tiny", "prompt": "Leave", "max_tokens": 240, "ignore_eos": True, "n": 16, "logprobs": 5}
        ).encode()
        with socket.create_connection((tiny_server.host, tiny_server.port)) as sock:  # closed once sent
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while '"POST' not in log.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tiny_server.log = sys.stderr
    # Among any other test's late /metrics polls (a ttft if its first token came before the server saw it gone):
    assert re.search(
        r'^127\.0\.0\.1 "POST /v1/completions" 499 (ttft=\S+ )?client=gone duration=\S+$', log.getvalue(), re.M
    )


def test_startup_says_where_sampling_defaults_come_from(server):
    # The default model is a preset named by --model, from a GGUF (no generation_config.json): its model card's.
    assert server.engine.sampling_source == "model card"
    note = sampling_note(server.engine, server.config)
    assert "get temperature 0.2, top_p 0.9: the model card's advice for smollm2-135m" in note, note


def test_disable_log_requests_flag():
    args = ["--disable-log-requests", "--model", "x"]
    from serve import _parser

    assert _parser().parse_args(args).disable_log_requests and not _parser().parse_args([]).disable_log_requests


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_chat_template_file(tiny, tmp_path):
    path = tmp_path / "t.jinja"
    # {% break %} needs the loop-controls extension of the environment checkpoint templates render in.
    path.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% if loop.last %}{% break %}{% endif %}{% endfor %}"
    )
    s = Server(
        EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu", chat_template=str(path)), port=0
    )
    s.start()
    try:
        assert s.wait_ready(120)
        ids = json.loads(request(s, "POST", "/tokenize", {"messages": CHAT})[1])["tokens"]
        assert s.engine.tokenizer.decode(ids) == "[user] What is the capital of France?\n"
    finally:
        s.stop()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    r = subprocess.run(
        [
            sys.executable,
            "serve.py",
            "--dummy-weights",
            "--num-kv-blocks",
            "16",
            "--chat-template",
            str(bad),
            "--port",
            "0",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("serve.py: error: chat template")
    with pytest.raises(ValueError, match="chat_template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "empty.jinja").write_text("\n")  # not the checkpoint's template in silence
    with pytest.raises(ValueError, match="empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))


def test_a_failing_lane_among_64_streams_with_disconnects(tiny_server, monkeypatch):
    """64 streams; a quarter leave after two chunks, their sequences stopped early, and one is made to fail
    (NaN logits): that one gets an error, every other stream completes, and afterwards nothing runs and
    no KV block is in use."""
    import runner

    sample = runner.sample

    def poisoned(logits, seqs, *rest):
        for i, seq in enumerate(seqs):
            if seq.params.seed == 13 and len(seq.output_token_ids) == 3:
                logits[i] = float("nan")
        return sample(logits, seqs, *rest)

    monkeypatch.setattr(runner, "sample", poisoned)

    async def one(client, i: int):
        stream = await client.completions.create(
            model="tiny", prompt=f"Story {i}:", max_tokens=12, seed=i, stream=True, extra_body={"ignore_eos": True}
        )
        text, reasons = "", []
        try:
            async for chunk in stream:
                text += chunk.choices[0].text
                reasons.append(chunk.choices[0].finish_reason)
                if i % 4 == 0 and len(reasons) == 2:
                    await stream.close()
                    return None
        except openai.APIError as e:
            return "error", str(e)
        return text, reasons[-1]

    async def go():
        client = openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        results = await asyncio.gather(*(one(client, i) for i in range(64)))
        await client.close()
        return results

    before = metrics(tiny_server)["generation_tokens_total"]
    results = asyncio.run(go())
    assert results[13][0] == "error" and "NaN" in results[13][1]
    assert all(r is None for r in results[::4])
    done = [r for i, r in enumerate(results) if i % 4 and i != 13]
    assert len(done) == 47 and all(reason == "length" and len(text) == 12 for text, reason in done)
    m = wait_metrics(tiny_server, lambda m: m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0)
    assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0
    # Unaborted, the leavers would have produced 16 * 12 tokens; aborted, at most a few past their two.
    assert m["generation_tokens_total"] - before <= 47 * 12 + 3 + 16 * 8


@pytest.fixture
def short_server():
    """tiny_server with a 96-token context: a chat that names no max_tokens fills what is left of it."""
    with serving_tiny(num_kv_blocks=256, enable_prefix_caching=True, max_model_len=96) as s:
        yield s


@pytest.mark.slow
def test_fuzz_the_api_from_its_openapi_description(short_server):
    """1,200 requests drawn from /openapi.json's fields, each field's value of its declared type or any JSON
    value: never a 5xx, never a hang, and afterwards a normal request is served and no KV is held."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = json.loads(request(short_server, "GET", "/openapi.json")[1])
    any_json = st.recursive(
        st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    )
    typed = {
        "integer": st.integers(-2, 6),
        "number": st.floats(-3, 3),
        "boolean": st.booleans(),
        "string": st.text(max_size=12),
        "array": st.lists(st.integers(0, 300) | st.text(max_size=4), max_size=4),
        "object": st.dictionaries(st.text(max_size=6), any_json, max_size=3),
    }

    def field(schema: dict) -> st.SearchStrategy:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return st.one_of(*(typed[k] for k in kinds), any_json)

    valid = {
        "messages": st.just(CHAT),
        "prompt": st.text(max_size=12) | st.lists(st.integers(0, 300), max_size=5),
        "tokens": st.lists(st.integers(0, 300), max_size=5),
    }
    posts = [
        (
            path,
            st.fixed_dictionaries(
                {k: valid[k] | field(t) for k, t in props.items() if k in required},
                optional={
                    k: (field(t) if k != "model" else st.just("tiny") | field(t))
                    for k, t in props.items()
                    if k not in required
                },
            ),
        )
        for path, item in spec["paths"].items()
        if "post" in item
        for schema in [item["post"]["requestBody"]["content"]["application/json"]["schema"]]
        for props, required in [(schema["properties"], schema["required"])]
    ]
    seen, conn = [], http.client.HTTPConnection(short_server.host, short_server.port, timeout=60)

    @settings(
        max_examples=1200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(st.sampled_from(posts).flatmap(lambda p: st.tuples(st.just(p[0]), p[1])))
    def case(arg):
        path, body = arg
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})  # kept alive
        r = conn.getresponse()
        status, raw = r.status, r.read()
        if r.will_close:
            conn.close()
        seen.append(status)
        assert status < 500, (path, body, raw)
        if status >= 400:
            assert json.loads(raw)["error"]["message"]

    case()
    print("fuzz statuses:", {s: seen.count(s) for s in sorted(set(seen))})
    assert len(seen) >= 1200 and seen.count(200) >= 60, {s: seen.count(s) for s in set(seen)}
    assert request(short_server, "POST", "/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200
    m = wait_metrics(short_server, lambda m: m["kv_cache_usage_perc"] == 0 and m["num_requests_running"] == 0)
    assert m["kv_cache_usage_perc"] == 0 and m["num_requests_running"] == 0


@pytest.mark.slow
def test_a_wheel_holds_everything_the_server_runs(tmp_path):
    """pip install . (not -e) packages every module, the kernel's sources and the live page: the server's
    modules import from the unpacked wheel alone, and the page sits where serve.py looks once installed."""
    import shutil
    import zipfile

    source = tmp_path / "source"  # a copy: pip builds in the source tree
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("laneserve-*.whl")))
    site = tmp_path / "site"
    wheel.extractall(site)
    # The checkout's own editable install would supply a module the wheel lacks: none may come from here.
    script = (
        "import os, sys, bench, serve; print(sorted(m for m, mod in list(sys.modules.items()) if os.path.dirname("
        "getattr(mod, '__file__', None) or '') in (sys.argv[1], *(os.path.join(sys.argv[1], d) "
        "for d in ('attention_cuda', 'server')))))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, ROOT],
        cwd=tmp_path,
        env={**ENV, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    assert {"attention_cuda/paged_attention.cu", "attention_cuda/binding.cpp"} <= set(wheel.namelist())
    assert "server/page.html" in wheel.namelist()


def test_cors_for_allowed_origins_only(tiny):
    """--allowed-origins: a page of an allowed origin may call the API from a browser, preflight included
    (which carries no API key); other origins get no CORS headers, so their scripts cannot read replies."""
    app = "http://app.example:3000"
    with serving(
        EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"),
        api_key="k",
        allowed_origins=(app,),
        log_requests=False,
    ) as s:

        def call(method: str, origin: str, headers: dict | None = None, body: dict | None = None):
            conn = http.client.HTTPConnection(s.host, s.port, timeout=60)
            conn.request(
                method, "/v1/completions", json.dumps(body) if body else None, {"Origin": origin, **(headers or {})}
            )
            r = conn.getresponse()
            r.read()
            conn.close()
            return r.status, r.getheader("Access-Control-Allow-Origin"), r

        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, allowed, r = call("OPTIONS", app, preflight)
        assert (
            (status, allowed) == (204, app)
            and r.getheader("Access-Control-Allow-Headers") == "authorization, content-type"
            and "POST" in r.getheader("Access-Control-Allow-Methods")
        )
        body = {"model": tiny, "prompt": [1, 2], "max_tokens": 2}
        for extra in ({}, {"stream": True}):
            assert call("POST", app, {"Authorization": "Bearer k"}, {**body, **extra})[:2] == (200, app)
        assert call("POST", app, {}, body)[:2] == (401, app)  # refusals readable too
        status, allowed, _ = call("OPTIONS", "http://evil.example", preflight)
        assert status != 204 and allowed is None
        assert call("POST", "http://evil.example", {"Authorization": "Bearer k"}, body)[:2] == (200, None)
