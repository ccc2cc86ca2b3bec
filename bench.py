"""Measurement: the throughput/latency curve over concurrency (or, as vLLM's benchmark_serving, over request rates),
goodput at an SLO, continuous vs static batching, offline throughput and, on request, a mixed short/long probe,
against any OpenAI-compatible server (the attention kernel has its own, bench_kernel.py). Also the `laneserve`
command: `laneserve serve` and `laneserve bench`.

Every number is taken from outside, as a user sees it: streamed over real HTTP, TTFT at the first content
chunk, ITL between content chunks, token counts from the server's usage. Every run stops by itself: each phase
gets a share of --time-limit, and whatever is in flight when its share is spent is cancelled and the phase
marked partial (*), so a slow machine yields a shorter measurement, never a hung one."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

import serve
from benchmarks import bench_plot
from cli import ArgumentParser, add_cli_args, from_cli_args
from config import DEFAULT_MODEL, EngineConfig
from engine import LLM, SamplingParams
from serve import Server

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPT = "Request {i}: write a long, detailed story about a lighthouse keeper who finds a message in a bottle."
# --workload repeat: the output repeats the input with one change, as edit, rewrite and retrieval prompts do (where
# speculative decoding's n-gram drafts, looked up in the prompt, are accepted). Its replies end where the model ends
# them (no ignore_eos): past its end a reply would be free text, no longer a repeat.
REPEAT_PROMPT = (
    "Request {i}: Repeat this paragraph word for word, with Monday changed to Tuesday:\n\n"
    "The library opens at nine on Monday and closes at six in the evening. Members may borrow up to five "
    "books at a time, and books are due back within three weeks. Late returns cost ten cents a day. The "
    "reading room on the second floor is quiet and has desks with lamps. Children's books are on the "
    "ground floor, next to the stairs. The library is closed on public holidays, and on the first Sunday "
    "of every month."
)
# vLLM's benchmark_serving table: its metric names, section titles and statistics ("Median" is p50 in the JSON).
METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
STATS = (("mean", "Mean"), ("p50", "Median"), ("p95", "P95"), ("p99", "P99"))
VOCAB = 10000  # random prompts' token ids are below this: every preset's vocabulary is larger
SERVE_URL = "http://127.0.0.1:8000"  # where serve.py (and vLLM) listen by default
# --quick: a first look in under a minute on a small CPU; flags given explicitly still win.
QUICK = {
    "concurrency": [1, 4],
    "max_tokens": 64,
    "requests_per_client": 1,
    "warmup": 1,
    "time_limit": 50,
    "num_prompts": 16,
    "min_len": 32,
    "max_len": 128,
}
USAGE = f"""bench.py --base-url {SERVE_URL} [options]   measure a server already running (serve.py, vLLM, ...)
   or: bench.py [options] [engine flags]                      start its own server in this process and measure it"""
DESCRIPTION = f"""\
Serving benchmark: vLLM's metrics (TTFT, TPOT, ITL, E2EL, throughput) over a sweep of concurrent streaming
clients, each sending its requests one after another.

--base-url measures any OpenAI-compatible server already running; --model then names the model to ask for
(default: the first the server lists). Without --base-url (the default) bench.py serves --model itself, set up
by the engine flags below, on a free loopback port, and measures it from a separate client process; a server
running on {SERVE_URL} is then not measured.

--request-rate R (an open loop, as vLLM's benchmark_serving) replaces the sweep: --num-prompts random prompts,
sent at R requests a second (Poisson arrivals; --burstiness for gamma) whether or not earlier ones are done.

--quick: concurrency 1 and 4, {QUICK["max_tokens"]} tokens, one request per client: under a minute on a 2-core CPU.
The full default sweep (1, 4, 16, 64 clients) takes up to --time-limit. --mixed-probe adds the mixed short/long
probe, --compare-static a static-batching server, --offline measures LLM.generate without HTTP."""


class BenchError(Exception):
    """Stops the run: results would be wrong (token counts disagree) or cannot be had (server failed)."""


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: ...)" only where there is one worth reading
        shown = action.default in (None, False) or "(default" in action.help  # the engine's flags say it already
        return action.help if shown else super()._get_help_string(action)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


def _number(kind: type, zero_ok: bool = False, most: float = math.inf):
    """An argparse type: a positive int or float (or zero, with zero_ok), at most `most`."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (value >= 0 if zero_ok else value > 0) or not math.isfinite(value) or value > most:
            bounds = f"{'>=' if zero_ok else '>'} 0" + (f" and <= {most:g}" if most < math.inf else "")
            raise argparse.ArgumentTypeError(f"{text} must be finite and {bounds}")
        return value

    return parse


def _rate(text: str) -> float:
    """--request-rate: requests a second, or inf (every request at once)."""
    try:
        return math.inf if text.lower() in ("inf", "infinity") else _number(float)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text} is not a rate: a number > 0, or inf") from None


def parse_args(argv: list[str] | None, prog: str = "bench.py") -> argparse.Namespace:
    usage = USAGE.replace("bench.py", prog)
    p = ArgumentParser(prog=prog, usage=usage, formatter_class=_Help, description=DESCRIPTION)
    a, pos, num, count = p.add_argument, _number(int), _number(float), _number(int, zero_ok=True)
    a("--base-url", help=f"measure this running OpenAI-compatible server (e.g. {SERVE_URL}) instead of starting one")
    a(
        "--quick",
        action="store_true",
        help="a short run: "
        + ", ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in QUICK.items()
        ),
    )
    a("--api-key", default="none", help="bearer token for --base-url")
    a("--compare-static", action="store_true", help="also run everything against a static-batching server")
    a("--offline", action="store_true", help="offline throughput through LLM.generate's step loop, no HTTP")
    a("--concurrency", type=pos, nargs="+", default=[1, 4, 16, 64], help="client counts to sweep")
    a(
        "--workload",
        choices=["chat", "repeat"],
        default="chat",
        help="the sweep's prompt: chat (write a story) or "
        "repeat (repeat a paragraph with one change, replies ending where the model ends them: where speculative "
        "decoding pays)",
    )
    a(
        "--max-tokens",
        type=pos,
        default=128,
        help="output tokens per sweep request (ignore_eos; --workload repeat: at most)",
    )
    a("--requests-per-client", type=pos, default=2, help="requests each client sends in turn, per level")
    a("--warmup", type=count, default=2, help="unmeasured requests before measuring")
    a(
        "--temperature",
        type=_number(float, zero_ok=True, most=2),
        default=0.0,  # the API's range: more gets HTTP 400
        help="sampling temperature (0: greedy, as vLLM's benchmark_serving.py sent; its `vllm bench serve` sends "
        "none, the server's default)",
    )
    a(
        "--structured-outputs",
        type=_json_object,
        metavar="JSON",
        help='vLLM\'s structured_outputs sent with every sweep request, such as \'{"regex": "[a-z ,.]+"}\': '
        "what a grammar costs (the server must take the field)",
    )
    a(
        "--top-p",
        type=_number(float, most=1),
        help="nucleus sampling's top_p (default: not sent, so the server's own default: the model card's, here)",
    )
    a(
        "--slo-ttft",
        type=num,
        help="goodput counts the requests whose TTFT is at most this, in ms (as vLLM's --goodput ttft:MS)",
    )
    a("--slo-tpot", type=num, help="... and whose TPOT is at most this, in ms (vLLM's --goodput tpot:MS)")
    a(
        "--mixed-probe",
        action="store_true",
        help="first, long and short requests sent together: does a short one "
        "wait for the long ones? (continuous vs static batching)",
    )
    a("--mixed-short", type=pos, default=8, help="--mixed-probe: max_tokens of the short requests")
    a("--mixed-long", type=pos, default=512, help="--mixed-probe: max_tokens of the long requests")
    a(
        "--mixed-num-short",
        type=count,
        default=16,
        help="--mixed-probe: short requests (0, without --mixed-probe: no probe, as the default)",
    )
    a("--mixed-num-long", type=pos, default=4, help="--mixed-probe: long requests")
    a(
        "--request-rate",
        type=_rate,
        nargs="+",
        metavar="R",
        help="the open loop instead of the sweep, one level per rate: requests a second, or inf (all at once); "
        "arrival gaps drawn from Gamma(burstiness, 1 / (R * burstiness)), seeded by --seed",
    )
    a("--burstiness", type=num, default=1.0, help="--request-rate: 1 is Poisson, below 1 burstier, above steadier")
    a(
        "--random-input-len",
        type=pos,
        default=1024,
        help="--request-rate: prompt tokens, sent as random token ids to /v1/completions (exact for any server "
        "that takes token-id prompts, as vLLM's and OpenAI's API do)",
    )
    a("--random-output-len", type=pos, default=128, help="--request-rate: output tokens (ignore_eos)")
    a(
        "--random-range-ratio",
        type=_number(float, zero_ok=True, most=1),
        default=0.0,
        help="--request-rate: each length uniform in [len * (1 - ratio), len * (1 + ratio)]",
    )
    a("--num-prompts", type=pos, default=256, help="prompts to process: --offline's, or the open loop's per rate")
    a("--min-len", type=pos, default=100, help="--offline: shortest prompt and output, tokens")
    a("--max-len", type=pos, default=1024, help="--offline: longest prompt and output, tokens")
    a("--time-limit", type=num, default=540, help="seconds for the whole run, model loading included")
    a("--request-timeout", type=num, default=300, help="seconds for one request")
    a("--json", metavar="PATH", help="write every number, per-request arrays and the configuration here")
    a("--plot", metavar="PATH", help="PNG: throughput vs p95 latency, and the mixed probe's timeline")
    add_cli_args(p, "engine (the in-process server's, as serve.py's)")
    p.set_defaults(model=None)  # with --base-url, a model given is the one requested; else the server's default
    args = p.parse_args(argv)
    if args.quick:  # parsed again on --quick's defaults, so that a flag given explicitly keeps its value
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    if args.offline and args.base_url:
        p.error("--offline and --base-url are separate modes; pick one")
    if args.base_url and args.compare_static:
        p.error("--compare-static needs the in-process server (it starts a static one); drop --base-url")
    if args.min_len > args.max_len:
        p.error(f"--min-len ({args.min_len}) is above --max-len ({args.max_len})")
    try:
        url = urllib.parse.urlsplit(args.base_url or "http://x")
        _ = url.port  # raises for a bad port
    except ValueError:
        url = None
    if not (url and url.scheme in ("http", "https") and url.netloc):
        p.error(f"--base-url must be an http:// or https:// URL (a port, if any, in 0-65535), got {args.base_url!r}")

    def changed(*names: str) -> list[str]:  # the flags among these given a value other than their default
        return [f"--{k.replace('_', '-')}" for k in names if getattr(args, k) != p.get_default(k)]

    offline_only = changed("min_len", "max_len") + ([] if args.request_rate else changed("num_prompts"))
    online_only = [
        flag
        for flag, given in (
            ("--compare-static", args.compare_static),
            ("--slo-ttft", args.slo_ttft),
            ("--slo-tpot", args.slo_tpot),
            ("--plot", args.plot),
            ("--mixed-probe", args.mixed_probe),
            ("--request-rate", args.request_rate),
        )
        if given
    ]
    open_only = changed("burstiness", "random_input_len", "random_output_len", "random_range_ratio")
    closed_only = changed("concurrency", "requests_per_client", "max_tokens", "workload")
    if args.offline:
        mode, wrong = "--offline", online_only + open_only
    elif args.request_rate:  # --plot draws its curve per client count
        mode, wrong = "--request-rate (the open loop)", offline_only + closed_only + (["--plot"] if args.plot else [])
    else:
        mode, wrong = "the sweep (those are --offline's or --request-rate's)", offline_only + open_only
    if wrong:
        p.error(f"{', '.join(wrong)}: not for {mode}")
    # The probe's sizes without the probe: a mistake, except --mixed-num-short 0 (how the probe was turned off).
    probe_sizes = changed("mixed_short", "mixed_long", "mixed_num_long") + (
        changed("mixed_num_short") if args.mixed_num_short else []
    )
    if probe_sizes and not args.mixed_probe:
        p.error(f"{', '.join(probe_sizes)}: the mixed probe's sizes; the probe runs only with --mixed-probe")
    if args.mixed_probe and not args.mixed_num_short:
        p.error("--mixed-probe needs short requests (--mixed-num-short > 0)")
    # --model and --seed stay: with --base-url they name the model to request and seed the open loop.
    knobs = (f.name for f in fields(EngineConfig) if "help" in f.metadata and f.name not in ("model", "seed"))
    engine_only = changed(*knobs)
    if args.base_url and engine_only:
        p.error(f"{', '.join(engine_only)}: not for --base-url (those set up the in-process server's engine)")
    for flag, values in (("--concurrency", args.concurrency), ("--request-rate", args.request_rate or [])):
        if len(set(values)) < len(values):
            p.error(f"{flag}: each level once, got {' '.join(f'{v:g}' for v in values)}")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # found out now, not after the run
        if path and (os.path.isdir(path) or not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK)):
            p.error(f"{flag}: cannot write {path} (a directory, or its directory is missing or read-only)")
    try:
        engine_config(args)
    except ValueError as e:
        p.error(str(e))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "bench.py: matplotlib is not installed, so --plot will be skipped (pip install matplotlib)", file=sys.stderr
        )
    return args


def engine_config(args: argparse.Namespace, scheduling: str | None = None) -> EngineConfig:
    return from_cli_args(args, **({"scheduling": scheduling} if scheduling else {}))


class Progress:
    """A one-line bar on stderr; a single summary line when stderr is not a terminal (logs, CI)."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.began, self.drawn = label, total, 0, time.perf_counter(), 0.0
        self.tty = sys.stderr.isatty()
        self.update(0)

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and (now - self.drawn > 0.1 or self.done == self.total):
            bar = "#" * (20 * self.done // max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{bar:<20}] {self.done}/{self.total} {now - self.began:.0f}s ")
            sys.stderr.flush()
            self.drawn = now

    def close(self, note: str = "") -> None:
        line = f"{self.label}: {self.done}/{self.total} in {time.perf_counter() - self.began:.1f}s {note}"
        sys.stderr.write(("\r" + line + " " * 10 + "\n") if self.tty else line + "\n")


@dataclass
class Request:
    """One streamed request as the client saw it; times in seconds from the start of its phase."""

    group: str  # "warmup", "sweep", "short" or "long"
    max_tokens: int
    ignore_eos: bool = True  # False: the reply may end before max_tokens (the repeat workload's)
    start: float = 0.0
    ttft: float | None = None  # to the first chunk with content
    itl: list[float] = field(default_factory=list)  # between chunks with content
    end: float | None = None  # None: cut by the time limit, or failed
    chunks: int = 0  # content chunks seen: a cut request's token count (no usage comes for it)
    prompt_tokens: int = 0
    output_tokens: int = 0  # from the server's usage
    error: str | None = None


class HTTPError(Exception):
    pass


class Client:
    """A bare HTTP/1.1 streaming client on asyncio: one connection per request, OpenAI's paths and error JSON.
    It costs a few microseconds per event (an SDK costs tens), so on a small machine the numbers measure the
    server rather than the client."""

    def __init__(self, base_url: str, api_key: str):
        url = base_url.rstrip("/")
        self.base = urllib.parse.urlsplit(url if url.endswith("/v1") else url + "/v1")
        self.url, self.api_key = self.base.geturl(), api_key

    async def _open(self, method: str, path: str, body: dict | None = None, root: bool = False):
        b = self.base
        reader, writer = await asyncio.open_connection(
            b.hostname,
            b.port or (443 if b.scheme == "https" else 80),
            ssl=True if b.scheme == "https" else None,
            limit=2**22,
        )
        data = json.dumps(body).encode() if body is not None else b""
        writer.write(
            f"{method} {'' if root else b.path}{path} HTTP/1.1\r\nHost: {b.netloc}\r\nConnection: close\r\n"
            f"Authorization: Bearer {self.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status_line = (await reader.readline()).split()
        headers = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return reader, writer, int(status_line[1]) if len(status_line) > 1 else 0, headers

    @staticmethod
    async def _body(reader, headers: dict):
        """The body's bytes as they arrive, chunked transfer coding undone."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0] or b"0", 16):
                yield await reader.readexactly(size)
                await reader.readexactly(2)
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            while data := await reader.read(2**16):
                yield data

    async def _fail(self, reader, headers: dict, status: int):
        raw = b"".join([c async for c in self._body(reader, headers)])
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:200]
        raise HTTPError(f"HTTP {status}: {message}")

    async def get(self, path: str) -> dict:
        reader, writer, status, headers = await self._open("GET", path)
        try:
            if status != 200:
                await self._fail(reader, headers, status)
            return json.loads(b"".join([c async for c in self._body(reader, headers)]))
        finally:
            writer.close()

    async def server_metrics(self) -> dict[str, float]:
        """vLLM's Prometheus samples at /metrics (beside /v1), each name's values summed over its labels; {} where
        the server has none."""
        reader, writer, status, headers = await self._open("GET", "/metrics", root=True)
        try:
            text = b"".join([c async for c in self._body(reader, headers)]).decode() if status == 200 else ""
        finally:
            writer.close()
        got: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and (parts := line.rsplit(" ", 1))[1:]:
                name = parts[0].split("{")[0]
                got[name] = got.get(name, 0.0) + float(parts[1])
        return got

    async def events(self, path: str, body: dict):
        """POST, then yield each server-sent event's data as parsed JSON (up to [DONE])."""
        reader, writer, status, headers = await self._open("POST", path, body)
        try:
            if status != 200:
                await self._fail(reader, headers, status)
            buf = b""
            async for data in self._body(reader, headers):
                *lines, buf = (buf + data).replace(b"\r\n", b"\n").split(b"\n")  # SSE allows CRLF
                for line in lines:
                    if line.startswith(b"data:"):
                        if (payload := line[5:].strip()) == b"[DONE]":
                            return
                        yield json.loads(payload)
            raise HTTPError("the stream ended before [DONE] (connection closed)")
        finally:
            writer.close()


async def stream_one(client: Client, model: str, req: Request, prompt: str | list[int], args, t0: float) -> None:
    """Fill req in place, so that a request cancelled at a time limit keeps what it measured. A text prompt is
    a chat message; token ids go to /v1/completions as they are."""
    req.start = time.perf_counter() - t0
    usage, last, ids = None, 0.0, isinstance(prompt, list)
    body = {
        "model": model,
        **({"prompt": prompt} if ids else {"messages": [{"role": "user", "content": prompt}]}),
        "max_tokens": req.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": req.ignore_eos,
        **({"top_p": args.top_p} if args.top_p is not None else {}),
        **({"structured_outputs": args.structured_outputs} if args.structured_outputs else {}),
    }
    try:
        async with asyncio.timeout(args.request_timeout):
            async for chunk in client.events("/completions" if ids else "/chat/completions", body):
                now = time.perf_counter() - t0
                if not isinstance(chunk, dict):
                    raise HTTPError(f"not an OpenAI chunk: {chunk!r:.100}")
                if "error" in chunk:
                    e = chunk["error"]
                    raise HTTPError(e.get("message", str(e)) if isinstance(e, dict) else str(e))
                choice = (chunk.get("choices") or [None])[0] or {}
                delta = choice.get("delta") or {}  # reasoning (vLLM's reasoning parsers) and calls are tokens too
                if choice.get("text") or any(
                    delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")
                ):
                    if req.ttft is None:
                        req.ttft = now - req.start
                    else:
                        req.itl.append(now - last)
                    last, req.chunks = now, req.chunks + 1
                usage = chunk.get("usage") or usage
    except TimeoutError:
        req.error = f"timed out after {args.request_timeout:g}s (--request-timeout)"
        return
    except (HTTPError, OSError, ValueError, asyncio.IncompleteReadError) as e:
        req.error = f"{type(e).__name__}: {e}"
        return
    req.end = time.perf_counter() - t0
    if usage is None:
        raise BenchError(
            "the server sent no usage in the stream (stream_options.include_usage); token counts would be guesses"
        )
    req.prompt_tokens, req.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    if req.output_tokens != req.max_tokens and req.ignore_eos or req.output_tokens > req.max_tokens:
        raise BenchError(
            f"asked for {req.max_tokens} tokens {'with ignore_eos' if req.ignore_eos else 'at most'}, "
            f"but the server's usage says {req.output_tokens}: it does not honour ignore_eos or "
            "max_tokens, so the numbers would not compare"
        )


async def run_until(coros: list, until: float) -> bool:
    """Run coros together, cancelling whatever is left at `until`; True if all finished. A BenchError in
    one stops the rest at once."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return True
    done, pending = await asyncio.wait(
        tasks, timeout=max(0.0, until - time.perf_counter()), return_when=asyncio.FIRST_EXCEPTION
    )
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        t.result()
    return not pending


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def summarize(reqs: list[Request], duration: float, args) -> dict:
    """vLLM's metrics for one phase. A cut request still contributes its TTFT, ITLs and streamed chunks
    (so a partial level's throughput counts the work done), but no E2EL or TPOT."""
    ok = [r for r in reqs if r.error is None]
    done = [r for r in ok if r.end is not None]
    out = sum(r.output_tokens for r in done) + sum(r.chunks for r in ok if r.end is None)
    inp = sum(r.prompt_tokens for r in done)
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.end - r.start for r in done],
        "tpot": [
            (r.end - r.start - r.ttft) / (r.output_tokens - 1)
            for r in done
            if r.output_tokens > 1 and r.ttft is not None
        ],
    }
    m: dict = {
        "completed": len(done),
        "failed": len(reqs) - len(ok),
        "unfinished": len(ok) - len(done),
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(done) / duration,
        "output_throughput": out / duration,
        "total_token_throughput": (inp + out) / duration,
        "per_request_output_throughput": float(np.mean([r.output_tokens / (r.end - r.start) for r in done]))
        if done
        else None,
        "first_error": next((r.error for r in reqs if r.error), None),
    }
    for name, *_ in METRICS:
        xs = [x * 1000 for x in series[name]]
        m[f"mean_{name}_ms"] = float(np.mean(xs)) if xs else None
        for q in (50, 95, 99):
            m[f"p{q}_{name}_ms"] = pct(xs, q)
    if args.slo_ttft or args.slo_tpot:  # vLLM's goodput: completed requests meeting every SLO, per second
        good = [
            r
            for r in done
            if r.ttft is not None
            and r.ttft * 1000 <= (args.slo_ttft or math.inf)
            and (
                r.output_tokens < 2
                or (r.end - r.start - r.ttft) / (r.output_tokens - 1) * 1000 <= (args.slo_tpot or math.inf)
            )
        ]
        m["goodput"] = len(good) / duration
    return m


def arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """vLLM's open loop: the send times of n requests in seconds, each after a gap drawn from Gamma(shape=burstiness,
    scale=1 / (rate * burstiness)): a mean of 1 / rate, a variance of 1 / (burstiness * rate**2) (burstiness 1:
    Poisson). Then, as vLLM, the times are scaled so that the last comes at exactly n / rate: a level's send window,
    and with it the throughput below saturation, does not move with the seed. An infinite rate sends every request
    at 0."""
    if math.isinf(rate):
        return [0.0] * n
    times = np.cumsum(np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), n))
    return (times * (n / rate / times[-1])).tolist()


def random_prompts(seed: int, n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int):
    """n prompts of random token ids below vocab, and their output lengths, each length uniform in its (lowest,
    highest): --offline's workload, and the open loop's (as vLLM's random dataset)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    return prompts, [rng.randint(*output_lens) for _ in range(n)]


def levels(args) -> tuple[str, list]:
    """What the sweep's levels vary, and their values: request rates (the open loop) or client counts."""
    return ("request_rate", args.request_rate) if args.request_rate else ("concurrency", args.concurrency)


def level_name(args, value) -> str:
    return f"{value:g} req/s" if args.request_rate else clients(value)


async def run_level(client, model: str, args, level: float, until: float, label: str) -> dict:
    """Closed loop: `level` clients, each sending --requests-per-client requests one after another. Open loop
    (--request-rate): --num-prompts random prompts sent at `level` requests a second, whether or not the earlier
    ones are done."""
    if args.request_rate:
        r, total = args.random_range_ratio, args.num_prompts
        # vLLM's bounds: floor below (at least 1), ceiling above
        spans = [
            (max(1, math.floor(n * (1 - r))), math.ceil(n * (1 + r)))
            for n in (args.random_input_len, args.random_output_len)
        ]
        work = zip(arrivals(total, level, args.burstiness, args.seed), *random_prompts(args.seed, total, *spans, VOCAB))
    else:
        total = level * args.requests_per_client
    t0, reqs = time.perf_counter(), []
    bar = Progress(f"{label}, {level_name(args, level)}", total)

    async def client_loop(c: int) -> None:
        for k in range(args.requests_per_client):
            if time.perf_counter() >= until:
                return
            reqs.append(r := Request("sweep", args.max_tokens, ignore_eos=args.workload != "repeat"))
            prompt = REPEAT_PROMPT if args.workload == "repeat" else PROMPT
            await stream_one(client, model, r, prompt.format(i=c * args.requests_per_client + k), args, t0)
            bar.update()

    async def arrive(at: float, prompt: list[int], max_tokens: int) -> None:
        await asyncio.sleep(at - (time.perf_counter() - t0))
        reqs.append(r := Request("sweep", max_tokens))
        await stream_one(client, model, r, prompt, args, t0)
        bar.update()

    async def watch_server() -> None:  # what the server says it runs: its batch size and preemptions
        while True:
            samples.append(await client.server_metrics())
            await asyncio.sleep(0.25)

    samples: list[dict[str, float]] = []
    watcher = asyncio.ensure_future(watch_server())
    senders = [arrive(*w) for w in work] if args.request_rate else [client_loop(c) for c in range(level)]
    complete = await run_until(senders, until)
    duration = time.perf_counter() - t0
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    try:  # the level's last word (a server without /metrics answers {}, one gone raises)
        async with asyncio.timeout(2):
            samples.append(await client.server_metrics())
    except (OSError, TimeoutError, ValueError):
        pass
    bar.close("" if complete else "(time limit: partial)")
    complete = complete and len(reqs) == total  # a client stopped by the limit
    metrics = summarize(reqs, duration, args)
    running = [m["vllm:num_requests_running"] for m in samples if "vllm:num_requests_running" in m]
    preempted = [m["vllm:num_preemptions_total"] for m in samples if "vllm:num_preemptions_total" in m]
    counts = {
        k: [m[f"vllm:{k}_total"] for m in samples if f"vllm:{k}_total" in m]
        for k in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "generation_tokens")
    }
    drafts, accepted, generated = (v[-1] - v[0] if v else 0 for v in counts.values())
    metrics |= {
        "spec_acceptance": accepted / drafts if drafts else None,  # speculation: drafts accepted
        # tokens a sequence gets per step it decodes in: 1 + accepted drafts per step
        "spec_tokens_per_step": generated / (generated - accepted) if drafts and generated > accepted else None,
    }
    metrics |= {
        "server_running_mean": float(np.mean(running)) if running else None,
        "server_running_max": int(max(running)) if running else None,
        "server_preemptions": int(preempted[-1] - preempted[0]) if preempted else None,
    }
    return {
        levels(args)[0]: level,
        **({"burstiness": args.burstiness} if args.request_rate else {}),
        "partial": not complete,
        "metrics": metrics,
        "requests": [asdict(r) for r in reqs],
    }


async def run_mixed(client, model: str, args, until: float, label: str) -> dict:
    """Long and short requests sent together: with continuous batching a short one leaves the batch as soon as
    it is done; with static batching it waits for the longest lane of its batch."""
    t0 = time.perf_counter()
    reqs = [Request("long", args.mixed_long) for _ in range(args.mixed_num_long)] + [
        Request("short", args.mixed_short) for _ in range(args.mixed_num_short)
    ]
    bar = Progress(f"{label}, mixed probe", len(reqs))

    async def one(i: int, r: Request) -> None:
        await stream_one(client, model, r, PROMPT.format(i=1000 + i), args, t0)
        bar.update()

    complete = await run_until([one(i, r) for i, r in enumerate(reqs)], until)
    duration = time.perf_counter() - t0
    bar.close("" if complete else "(time limit: partial)")
    longs, shorts = [r for r in reqs if r.group == "long"], [r for r in reqs if r.group == "short"]
    first_long = min((r.end for r in longs if r.end is not None), default=float("inf"))
    # Static batching releases a batch's results in one step, where arrival order is noise: a short request
    # counts as earlier only if it finished at least one decode step (the long ones' median ITL) before.
    step = pct([x for r in longs for x in r.itl], 50) or 0.0
    before = sum(r.end is not None and r.end < first_long - step for r in shorts)
    return {
        "partial": not complete,
        "duration_s": duration,
        "short": summarize(shorts, duration, args),
        "long": summarize(longs, duration, args),
        "short_before_first_long": before / len(shorts) if any(r.end is not None for r in shorts) else None,
        "requests": [asdict(r) for r in reqs],
    }


def strict_json(x):
    """x with each float that JSON cannot hold (--request-rate inf) as a string, "inf", as vLLM's result files have
    it: Python's json would write Infinity, which strict parsers (jq, JavaScript) refuse."""
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def pick_goodput(sweep: list[dict], args) -> dict | None:
    """The level of the highest goodput: the most requests a second that meet the SLO."""
    if not (args.slo_ttft or args.slo_tpot):
        return None
    best = max((lv for lv in sweep if lv["metrics"]["goodput"]), key=lambda lv: lv["metrics"]["goodput"], default=None)
    key = levels(args)[0]
    return {
        "slo_ttft_ms": args.slo_ttft,
        "slo_tpot_ms": args.slo_tpot,
        key: best and best[key],
        "goodput": best and best["metrics"]["goodput"],
    }


def start_server(args, scheduling: str, until: float, report: dict) -> Server:
    """The engine behind real HTTP on a free loopback port, served from this process."""
    print(f"bench.py: starting an in-process {scheduling} server ...", file=sys.stderr)
    server = Server(engine_config(args, scheduling), port=0, log_requests=False)
    server.start()
    try:
        if not server.wait_ready(max(1.0, until - time.perf_counter())):
            raise BenchError("the model did not load within the time limit (--time-limit)")
    except (RuntimeError, BenchError) as e:
        server.stop()
        raise BenchError(f"the model failed to load: {e}") from None
    e = server.engine
    report["config"].setdefault("engine", {})[scheduling] = {
        **asdict(e.config),
        "device": str(e.device),
        "dtype": str(e.dtype).removeprefix("torch."),
        "max_model_len": e.max_model_len,
        "num_kv_blocks": e.block_manager.num_blocks,
    }
    return server


async def measure(args, url: str, label: str, until: float) -> tuple[dict, str | None, str | None]:
    """Warm-up, the mixed probe and the sweep against one server: (the run, the served model, the error that
    stopped it, if one did). What was measured before an error is kept."""
    client, model = Client(url, args.api_key), None
    run = {"sweep": [], "mixed": None, "goodput": None}
    try:
        try:
            async with asyncio.timeout(min(args.request_timeout, until - time.perf_counter())):  # a mute server
                model = args.model if args.base_url and args.model else (await client.get("/models"))["data"][0]["id"]
        except TimeoutError:
            raise BenchError(
                f"cannot list the models at {client.url}: no answer within --request-timeout "
                f"({args.request_timeout:g}s) or the time left of --time-limit"
            ) from None
        except (HTTPError, OSError, ValueError, KeyError, IndexError) as e:
            raise BenchError(f"cannot list the models at {client.url}: {e}") from None
        t0, warm = time.perf_counter(), [Request("warmup", min(16, args.max_tokens)) for _ in range(args.warmup)]
        if not await run_until(
            [stream_one(client, model, r, PROMPT.format(i=-1 - j), args, t0) for j, r in enumerate(warm)], until
        ):
            raise BenchError("the warm-up used up --time-limit before anything was measured; raise --time-limit")
        if err := next((r.error for r in warm if r.error), None):
            raise BenchError(f"warm-up request failed: {err}")
        if args.mixed_probe:  # first: a fixed, small workload, at most 40% of the time; the sweep adapts
            mixed_until = time.perf_counter() + (until - time.perf_counter()) * 0.4
            run["mixed"] = await run_mixed(client, model, args, mixed_until, label)
        values = levels(args)[1]
        for j, v in enumerate(values):  # equal shares; a level done early leaves its rest to later ones
            level_until = time.perf_counter() + (until - time.perf_counter()) / (len(values) - j)
            run["sweep"].append(await run_level(client, model, args, v, level_until, label))
        run["goodput"] = pick_goodput(run["sweep"], args)
    except BenchError as e:
        return run, model, str(e)
    return run, model, None


def _measure_in_child(args, url: str, label: str, seconds: float, conn) -> None:
    conn.send(asyncio.run(measure(args, url, label, time.perf_counter() + seconds)))


def say_which_server(args) -> None:
    """A vLLM user may expect the server already running on the default address to be the one measured: say
    which is, and note one answering there (a refused connect returns at once)."""
    print(
        f"bench.py: starting its own server in this process ({args.model or DEFAULT_MODEL}) to measure; to "
        f"measure a server already running, pass --base-url {SERVE_URL}",
        file=sys.stderr,
    )
    url = urllib.parse.urlsplit(SERVE_URL)
    try:
        socket.create_connection((url.hostname, url.port), timeout=0.2).close()
    except OSError:
        return
    print(
        f"bench.py: note: the server answering on {SERVE_URL} is not measured; --base-url {SERVE_URL} measures it",
        file=sys.stderr,
    )


def run_online(args, deadline: float, report: dict) -> None:
    if not args.base_url:
        say_which_server(args)
    labels = ["remote"] if args.base_url else ["continuous", "static"] if args.compare_static else [args.scheduling]
    for i, label in enumerate(labels):
        until = time.perf_counter() + (deadline - time.perf_counter()) / (len(labels) - i)  # a fair share each
        if args.base_url:
            run, model, error = asyncio.run(measure(args, args.base_url, label, until))
        else:
            # The client runs in a process of its own, as it would against a deployed server: sharing the
            # server's process it would hold the GIL the engine loop needs between ops.
            server = start_server(args, label, until, report)
            try:
                ctx = multiprocessing.get_context("spawn")
                receive, send = ctx.Pipe(duplex=False)
                child = ctx.Process(
                    target=_measure_in_child,
                    daemon=True,
                    args=(args, server.url, label, until - time.perf_counter(), send),
                )
                child.start()
                send.close()  # the child's copy is the only one left, so its death reads as EOF, not a hang
                try:
                    run, model, error = receive.recv()
                except EOFError:
                    raise BenchError(f"the client process died (exit code {child.join(5) or child.exitcode})") from None
                child.join()
            finally:
                server.stop()
                del server  # with its engine gone, the next label's server gets the same memory (GPU KV sizing)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        report["config"].setdefault("served_model", model)
        report["runs"][label] = run
        if error:
            raise BenchError(error)


def run_offline(args, deadline: float, report: dict) -> None:
    """nano-vllm's bench: random token-id prompts and output lengths, ignore_eos. The loop is generate()'s own,
    written out so that the time limit can stop it between steps."""
    try:
        llm = LLM(engine_config(args))
    except Exception as e:  # as the in-process server reports its load's: a missing checkpoint, no such device, ...
        raise BenchError(f"the model failed to load: {e}") from None
    report["config"]["engine"] = {
        **asdict(llm.config),
        "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."),
    }
    lens = (args.min_len, args.max_len)
    prompts, outs = random_prompts(args.seed, args.num_prompts, lens, lens, min(llm.model_config.vocab_size, VOCAB))
    try:
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up, unmeasured
    except ValueError as e:  # an engine too small for even these 7 tokens
        raise BenchError(f"--offline warm-up: {e} (see the engine's size knobs)") from None
    before, bar, t0 = llm.num_generation_tokens, Progress("offline", args.num_prompts), time.perf_counter()
    try:
        for p, n in zip(prompts, outs):
            llm.add_request(
                p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature, top_p=args.top_p or 1.0)
            )
    except ValueError as e:  # a sequence the engine can never hold
        raise BenchError(f"--offline: {e} (see --min-len, --max-len and the engine's size knobs)") from None
    finished = 0
    while llm.has_unfinished() and time.perf_counter() < deadline:
        done = sum(o.finished for o in llm.step())
        finished += done
        bar.update(done)
    elapsed = time.perf_counter() - t0
    bar.close("" if finished == args.num_prompts else "(time limit: partial)")
    generated = llm.num_generation_tokens - before
    report["offline"] = {
        "num_prompts": args.num_prompts,
        "finished": finished,
        "partial": finished < args.num_prompts,
        "prompt_tokens": sum(map(len, prompts)),
        "requested_output_tokens": sum(outs),
        "output_tokens": generated,
        "time_s": elapsed,
        "output_throughput": generated / elapsed,
        "prompt_lens": [len(p) for p in prompts],
        "output_lens": outs,
    }


def fmt(x) -> str:
    return "-" if x is None else str(x) if isinstance(x, int) else f"{x:.2f}"


def clients(c: int) -> str:
    return f"{c} client{'s' if c > 1 else ''}"


def print_report(report: dict, args) -> None:
    w = 42
    runs = report.get("runs", {})
    if any(run["sweep"] for run in runs.values()):  # nothing measured (the server unreachable, say): no table
        key, values = levels(args)
        cols = [(v, label) for v in values for label in runs]
        by = {(lv[key], label): lv for label, run in runs.items() for lv in run["sweep"]}
        heads = [[level_name(args, v) + ("*" if by.get((v, label), {}).get("partial") else "") for v, label in cols]]
        heads += [[label for _, label in cols]] if len(runs) > 1 else []  # continuous and static side by side
        server = args.base_url if args.base_url else f"its own, in this process, {' and '.join(runs)} batching"
        rows = [
            ("Successful requests", "completed"),
            ("Failed requests", "failed"),
            ("Benchmark duration (s)", "duration_s"),
            ("Total input tokens", "total_input_tokens"),
            ("Total generated tokens", "total_output_tokens"),
            ("Request throughput (req/s)", "request_throughput"),
            ("Output token throughput (tok/s)", "output_throughput"),
            ("Total Token throughput (tok/s)", "total_token_throughput"),  # vLLM's capital T
            ("Per-request output throughput (tok/s)", "per_request_output_throughput"),
            ("Running requests, server (mean)", "server_running_mean"),  # sampled at /metrics
            ("Running requests, server (max)", "server_running_max"),
            ("Preemptions, server", "server_preemptions"),
            ("Draft acceptance, server", "spec_acceptance"),
            ("Tokens per sequence-step, server", "spec_tokens_per_step"),
        ]
        rows += [("Request goodput (req/s)", "goodput")] if args.slo_ttft or args.slo_tpot else []
        for name, label, section in METRICS:
            rows += [(section, None)] + [(f"{s} {label} (ms)", f"{k}_{name}_ms") for k, s in STATS]
        print(f"\n{' Serving Benchmark Result ':=^{w + 14 * len(cols)}}")
        print(f"Server: {server}; model {report['config'].get('served_model')}")
        n, spread = args.requests_per_client, f" +-{args.random_range_ratio:.0%}" if args.random_range_ratio else ""
        if args.request_rate:  # vLLM's random dataset
            arrive = "Poisson" if args.burstiness == 1 else f"gamma (burstiness {args.burstiness:g})"
            workload = (
                f"random; {args.num_prompts} requests a rate, {args.random_input_len}{spread} prompt token ids "
                f"(/v1/completions) and {args.random_output_len}{spread} output tokens (ignore_eos), {arrive} arrivals"
            )
        else:
            sends = "1 request" if n == 1 else f"{n} requests one after another"
            workload = f"{args.workload}; each client sends {sends} of {args.max_tokens} output tokens (ignore_eos)"
        print(
            f"Workload: {workload}, temperature {args.temperature:g}"
            + (f", top_p {args.top_p:g}" if args.top_p is not None else "")
        )
        head = "Request rate" if args.request_rate else "Concurrency (clients)"
        for i, cells in enumerate(heads):
            print(f"{head if i == 0 else 'Batching':<{w}}" + "".join(f"{h:>14}" for h in cells))
        for title, metric in rows:
            if metric is None:
                print(f"{title:-^{w + 14 * len(cols)}}")
                continue
            print(
                f"{title:<{w}}"
                + "".join(f"{fmt(by[c].get('metrics', {}).get(metric)) if c in by else '-':>14}" for c in cols)
            )
        print("=" * (w + 14 * len(cols)))
        if any(lv["partial"] for lv in by.values()):
            print("* partial: the level's share of --time-limit ran out; counts include tokens streamed so far")
        for label, run in runs.items():
            if g := run.get("goodput"):
                where = f"{fmt(g['goodput'])} req/s at {level_name(args, g[key])}" if g[key] else "no request meets it"
                print(
                    f"Best goodput [{label}] at TTFT <= {fmt(g['slo_ttft_ms'])} ms, TPOT <= "
                    f"{fmt(g['slo_tpot_ms'])} ms: {where}"
                )
        mixed = {label: run["mixed"] for label, run in runs.items() if run.get("mixed")}
        if mixed:
            print(
                f"\n{'Mixed probe':<{w}}"
                + "".join(f"{label + ('*' if m['partial'] else ''):>14}" for label, m in mixed.items())
            )
            for title, group, key in [
                (f"Short requests done (max_tokens {args.mixed_short})", "short", "completed"),
                (f"Long requests done (max_tokens {args.mixed_long})", "long", "completed"),
                ("Mean short E2EL (ms)", "short", "mean_e2el_ms"),
                ("P95 short E2EL (ms)", "short", "p95_e2el_ms"),
                ("Mean short TTFT (ms)", "short", "mean_ttft_ms"),
                ("Mean long E2EL (ms)", "long", "mean_e2el_ms"),
                ("Mean long TTFT (ms)", "long", "mean_ttft_ms"),
            ]:
                print(f"{title:<{w}}" + "".join(f"{fmt(m[group][key]):>14}" for m in mixed.values()))
            print(
                f"{'Short finished before first long (%)':<{w}}"
                + "".join(
                    f"{fmt(None if m['short_before_first_long'] is None else 100 * m['short_before_first_long']):>14}"
                    for m in mixed.values()
                )
            )
    if o := report.get("offline"):
        print(
            f"\nOffline: {o['finished']}/{o['num_prompts']} sequences{' (partial)' if o['partial'] else ''}, "
            f"{o['prompt_tokens']} prompt tokens, {o['output_tokens']} output tokens in {o['time_s']:.2f}s: "
            f"{o['output_throughput']:.2f} output tok/s"
        )


def versions() -> dict:
    try:
        rev = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        rev = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "laneserve_git": rev,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None, prog: str = "bench.py") -> int:
    args = parse_args(argv, prog)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    deadline = time.perf_counter() + args.time_limit
    knobs = {**vars(args), "api_key": "(set)" if args.api_key != "none" else None}  # no secrets in reports
    report: dict = {
        "config": {
            "knobs": knobs,
            "model": args.model or DEFAULT_MODEL,
            "base_url": args.base_url,
            "versions": versions(),
        },
        "runs": {},
    }
    error = None
    try:
        if args.offline:
            run_offline(args, deadline, report)
        else:
            run_online(args, deadline, report)
    except BenchError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    print_report(report, args)  # whatever was measured, even after an error
    if args.json:
        with open(args.json, "w") as f:
            json.dump(strict_json(report), f, indent=1, allow_nan=False)
    if args.plot and report["runs"] and importlib.util.find_spec("matplotlib") is not None:
        bench_plot.plot(report, args.plot)
    phases = [
        (f"{label}, {level_name(args, lv[levels(args)[0]])}", lv["metrics"])
        for label, run in report["runs"].items()
        for lv in run["sweep"]
    ]
    phases += [
        (f"{label}, mixed probe {g}", run["mixed"][g])
        for label, run in report["runs"].items()
        if run["mixed"]
        for g in ("short", "long")
    ]
    failed = [f"{name}: {m['failed']} failed, first: {m['first_error']}" for name, m in phases if m["failed"]]
    if error or failed:
        print(f"{prog}: error: {error or 'requests failed: ' + '; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def exit_code(rc: int) -> int:
    """rc, for a process about to exit with it: exiting at once where a model load still runs."""
    if any(t.name == "engine" for t in threading.enumerate()):
        # An in-process server's model load that --time-limit (or ^C) cut short still runs on its engine thread:
        # torch cannot be interrupted mid-load, and finalizing the interpreter under it aborts the process (as
        # serve.py's main says). Otherwise exit normally: atexit ends tensor-parallel workers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


LANESERVE_USAGE = """\
usage: laneserve serve [MODEL] [options]   an OpenAI-compatible server, as python serve.py
   or: laneserve bench [options]           measure a server (vLLM's metrics), as python bench.py
laneserve serve --help and laneserve bench --help list the options; laneserve --version says which laneserve"""


def laneserve(argv: list[str] | None = None) -> int:
    """The `laneserve` command that pip installs (setup.py's console script)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):  # no command: the usage, as an error
        print(LANESERVE_USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"laneserve {serve.version()}")
        return 0
    if argv[0] == "serve":
        return serve.main(argv[1:], "laneserve serve")
    if argv[0] == "bench":
        return exit_code(main(argv[1:], "laneserve bench"))
    print(f"laneserve: error: no command {argv[0]!r}: serve or bench (see laneserve --help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(exit_code(main()))
