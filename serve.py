"""HTTP: an OpenAI-compatible server on the standard library, the engine stepping on its own thread. What
the API's fields mean and how replies are shaped is openai_api.py's; this file carries them over HTTP.

The engine is not thread-safe, so request threads never touch it: they parse, validate and tokenize,
post commands to the engine thread's inbox and read results from their own queue. The engine thread
drains its inbox between steps and only ever puts to unbounded queues, so no client can stall a step."""
from __future__ import annotations

import argparse
import hmac
import importlib.metadata
import json
import os
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import openai_api
from openai_api import ApiError
from config import EngineConfig, add_cli_args, from_cli_args
from engine import Engine, RequestOutput, SamplingParams
from events import StepEvents
from parallel import WorkerFailure, launched_by_torchrun
from runner import run_worker
from sequence import require

# The live page at /: beside this file in a checkout, under <prefix>/share/laneserve once pip-installed.
PAGES = (os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html"),
         os.path.join(sys.prefix, "share", "laneserve", "page.html"))
# Histogram bounds in seconds, vLLM's, so that dashboards and quantiles carry over; on a CPU a long prompt's
# TTFT or a long reply takes minutes, which the upper ones keep out of +Inf.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


class Histogram:
    """A Prometheus histogram; only the engine thread observes, so it needs no lock."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, upper in enumerate(self.buckets):
            self.counts[i] += value <= upper  # kept cumulative, as exposed

    def lines(self, name: str, label: str) -> list[str]:
        return [*(f'{name}_bucket{{{label},le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)),
                f'{name}_bucket{{{label},le="+Inf"}} {self.count}', f"{name}_sum{{{label}}} {self.sum}",
                f"{name}_count{{{label}}} {self.count}"]


@dataclass
class Submit:
    """One HTTP request's sequences (n per prompt), added all together or not at all."""
    seqs: list[tuple[str, list[int], SamplingParams]]
    replies: queue.Queue  # first None (accepted) or an ApiError, then RequestOutputs
    submitted: float = field(default_factory=time.monotonic)


@dataclass
class Stream:
    """Where the engine thread puts one sequence's outputs, and when it last produced one."""
    replies: queue.Queue
    submitted: float
    last: float  # when submitted, then when it last produced a token
    started: bool = False


class HTTPServer(ThreadingHTTPServer):
    request_queue_size = 1024  # the default backlog of 5 resets clients that connect all at once
    block_on_close = False     # stop() must not wait for idle keep-alive connections

    def __init__(self, address: tuple[str, int], handler: type, app: Server):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET  # ::1 and the like
        self.app = app
        super().__init__(address, handler)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone mid-request is routine: no traceback
            super().handle_error(request, client_address)


class Server:
    def __init__(self, config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_queue: int = 1024, served_model_name: str | None = None, request_timeout: float | None = None,
                 log_requests: bool = True, allowed_origins: tuple[str, ...] = ()):
        self.config, self.host, self.port, self.api_key, self.max_queue = config, host, port, api_key, max_queue
        self.served_model_name = served_model_name
        self.request_timeout = request_timeout  # seconds from submission; the request then ends, its KV freed
        self.timeout = 30.0  # per-connection socket timeout: a stalled client holds only its own thread
        self.max_body = 8 * 2**20  # bytes
        self.allowed_origins = allowed_origins  # web pages (scheme://host:port, or "*") whose scripts may call us
        self.engine: Engine | None = None  # set once loaded
        self.model_names: list[str] = []   # the served name first, then others a request may use
        self.stats: dict[str, float] = {}  # the engine's, snapshot by its thread: it alone may read the engine
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.queue_time, self.e2e = Histogram(REQUEST_BUCKETS), Histogram(REQUEST_BUCKETS)
        self.log = sys.stderr if log_requests else None  # one access-log line per request
        self.steps = StepEvents()  # what /v1/engine/steps streams to the live page
        self._inbox: queue.Queue[Submit | list[str] | None] = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.dead: str | None = None  # why the engine thread died, once it has
        self.stopped = False
        self._httpd: HTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self.handling = 0  # requests being answered (not idle keep-alive connections)
        self.handling_changed = threading.Condition()

    def start(self) -> None:
        """Bind and serve at once; the model loads on the engine thread (/health answers 503 until then)."""
        self._httpd = HTTPServer((self.host, self.port), Handler, self)
        self.port = self._httpd.server_address[1]
        host = self.host or "0.0.0.0"  # "" binds every interface too
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        # serve_forever looks for stop()'s shutdown between polls: every 50 ms rather than its default 500.
        self._threads = [threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="http", daemon=True),
                         threading.Thread(target=self._engine_loop, name="engine", daemon=True)]
        for t in self._threads:
            t.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded; RuntimeError if loading failed."""
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise RuntimeError(str(self._load_error)) from self._load_error
        return self._ready.is_set()

    def stop(self) -> None:
        self.stopped = True
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        self._inbox.put(None)
        if self._ready.is_set():  # a load in progress cannot be interrupted; its daemon thread dies with us
            for t in self._threads:
                t.join(timeout=30)
        # The request threads die with the process: let them write the answers they hold (the 503s too).
        with self.handling_changed:
            self.handling_changed.wait_for(lambda: not self.handling, timeout=5)

    def submit(self, item: Submit | list[str]) -> None:
        """Sequences to add, or request ids to abort; any thread."""
        self._inbox.put(item)
        if self.dead:  # nobody else will answer it: whichever of us drains after `dead` is set does
            self._refuse_inbox([])

    def _refuse_inbox(self, items: list) -> None:
        """Answer every request in items (taken from the inbox) or still in the inbox with the engine's death."""
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, Submit):  # an accepted one reads this after its None, and stops there
                item.replies.put(ApiError(503, self.dead))

    def _engine_loop(self) -> None:
        c = self.config
        try:
            engine = Engine(c)
            engine.on_step = self.steps.publish
            self.model_names = [self.served_model_name] if self.served_model_name else list(dict.fromkeys(
                [c.model, *(os.path.basename(p.rstrip("/")) for p in (c.model, engine.checkpoint_path) if p)]))
            self.stats = engine.stats()
            self.engine = engine
        except BaseException as e:  # wait_ready reports it
            self._load_error = e
            return
        finally:
            self._ready.set()
        streams: dict[str, Stream] = {}
        items: list[Submit | list[str] | None] = []  # what the loop has taken from the inbox
        try:
            self._serve(engine, streams, items)
        except BaseException as e:  # a bug outside a step, or a lost worker: say so everywhere instead of hanging
            traceback.print_exc()
            self.dead = (str(e) if isinstance(e, WorkerFailure)
                         else f"the engine thread died ({type(e).__name__}: {e}); restart the server")
            for stream in streams.values():
                stream.replies.put(ApiError(503, self.dead))
            self._refuse_inbox(items)
        finally:
            engine.close()

    def _serve(self, engine: Engine, streams: dict[str, Stream], items: list) -> None:
        while True:
            # Block on the inbox only when idle; with work pending take what is there and step.
            items[:] = [] if engine.has_unfinished() else [self._inbox.get()]
            while not self._inbox.empty():
                items.append(self._inbox.get_nowait())
            if None in items:
                break
            for item in items:
                if isinstance(item, Submit):
                    item.replies.put(self._add(item, streams))
                    continue
                for rid in item:
                    engine.abort(rid)
                    streams.pop(rid, None)
            try:
                outputs = engine.step() if engine.has_unfinished() else []
            except WorkerFailure:  # the model is gone: the server cannot serve again
                raise
            except Exception:  # fail the requests in flight, keep serving
                traceback.print_exc()
                for rid, stream in streams.items():
                    engine.abort(rid)
                    stream.replies.put(ApiError(500, "the engine failed on this step; see the server log"))
                streams.clear()
                outputs = []
            now = time.monotonic()
            for out in outputs:
                if (stream := streams.get(out.request_id)) is None:
                    continue
                if not stream.started and out.queue_time is not None:
                    self.queue_time.observe(out.queue_time)
                (self.itl if stream.started else self.ttft).observe(now - stream.last)
                stream.last, stream.started = now, True
                stream.replies.put(ApiError(500, f"this request failed: {out.error}") if out.error else out)
                if out.finished:
                    self.e2e.observe(now - stream.submitted)
                    del streams[out.request_id]
            self.stats = engine.stats()
        for stream in streams.values():
            stream.replies.put(ApiError(503, "the server is shutting down"))

    def _add(self, job: Submit, streams: dict[str, Stream]) -> ApiError | None:
        """Adds all of job's sequences and returns None, or adds none and returns why."""
        s, c = self.engine.stats(), self.config
        # The next step admits sequences into the batch's free places (KV allowing), so only those beyond wait;
        # nothing is admitted while any is swapped out, or while a static batch runs.
        busy = s["num_swapped"] or c.scheduling == "static" and s["num_running"]
        free = 0 if busy else c.max_num_seqs - s["num_running"]
        waiting = s["num_waiting"] + s["num_swapped"]
        if len(job.seqs) > self.max_queue + c.max_num_seqs:  # never accepted: a 429 would have the client retry
            return ApiError(400, f"this request has {len(job.seqs)} sequences (prompts times n), more than the "
                                 f"server takes (--max-num-seqs {c.max_num_seqs} plus --max-queue {self.max_queue})")
        if waiting + len(job.seqs) - free > self.max_queue:
            return ApiError(429, f"{waiting} requests are waiting (--max-queue {self.max_queue}); retry later",
                            code="rate_limit_exceeded")
        added: list[str] = []
        try:
            for rid, ids, params in job.seqs:
                added.append(self.engine.add_request(ids, params, rid))
        except Exception as e:  # ValueError: an impossible request (context, empty prompt, pool too small)
            for rid in added:
                self.engine.abort(rid)
            return ApiError(400 if isinstance(e, ValueError) else 500, str(e))
        streams.update((rid, Stream(job.replies, job.submitted, job.submitted)) for rid in added)
        return None


def _version() -> str:
    try:
        return importlib.metadata.version("laneserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout pip never installed
        return "unknown"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, which the openai client uses; streams go chunked
    default_request_version = "HTTP/1.1"  # a request line without a version still gets a status line
    server_version = "laneserve"
    server: HTTPServer

    def setup(self) -> None:
        # Headers and body leave in separate writes; with Nagle's algorithm on, a keep-alive client's
        # delayed ACK would hold the second one back 40 ms.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.app = self.server.app
        self.timeout = self.app.timeout
        self.checked = 0.0  # when _next last looked for a closed client socket
        super().setup()

    def log_message(self, format: str, *args) -> None:
        pass  # clients' protocol errors get their answer and idle keep-alive timeouts are routine: no log

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (bad request line, unknown method, oversized headers) as OpenAI JSON, not HTML."""
        self.close_connection = True
        self._send(code, ApiError(code, message or HTTPStatus(code).phrase).body())

    def end_headers(self) -> None:
        # CORS: a page of an allowed origin may read our answers. (No headers yet: a refused request line.)
        if origin := self._origin():
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def _origin(self) -> str | None:
        origin, allowed = getattr(self, "headers", None) and self.headers.get("Origin"), self.app.allowed_origins
        return origin if origin and ("*" in allowed or origin in allowed) else None

    def do_GET(self) -> None:
        app = self.app
        with app.handling_changed:
            app.handling += 1
        try:
            self._answer()
        finally:
            with app.handling_changed:
                app.handling -= 1
                app.handling_changed.notify_all()

    def _answer(self) -> None:
        began, self.status, self.log_info = time.monotonic(), 0, {}
        if self.command == "OPTIONS" and self._origin() and self.headers.get("Access-Control-Request-Method"):
            # A browser's CORS preflight (it carries no API key): which methods and headers the request may use.
            self._head(204, [("Access-Control-Allow-Methods", "GET, POST"), ("Access-Control-Max-Age", "600"),
                             ("Access-Control-Allow-Headers", self.headers.get("Access-Control-Request-Headers", "")),
                             ("Content-Length", "0")])
            return
        method = "GET" if self.command == "HEAD" else self.command  # HEAD: GET's headers, no body
        if method != "POST" and (method != "GET" or "Transfer-Encoding" in self.headers
                                 or self.headers.get("Content-Length", "0").strip() != "0"):
            self.close_connection = True  # a body it may carry stays unread: it must not pass for the next request
        try:
            try:
                body = self._read_body() if method == "POST" else b""
            except ApiError:
                self.close_connection = True  # the body's unread rest would be taken for the next request
                raise
            try:
                self.route = path = urlsplit(self.path).path
            except ValueError:  # such as http://[/health
                raise ApiError(400, f"malformed request target {self.path[:200]!r}") from None
            if path.startswith("/v1/") and self.app.api_key and not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode("latin-1"), f"Bearer {self.app.api_key}".encode()):
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
            routes = {("GET", "/"): self._page, ("GET", "/v1/engine/steps"): self._steps,
                      ("GET", "/health"): self._health, ("GET", "/metrics"): self._metrics,
                      ("GET", "/version"): lambda: self._send(200, {"version": _version()}),
                      ("GET", "/openapi.json"): lambda: self._send(200, openai_api.openapi(_version())),
                      ("POST", "/tokenize"): lambda: self._tokenize(body),
                      ("POST", "/detokenize"): lambda: self._detokenize(body), ("GET", "/v1/models"): self._models,
                      ("POST", "/v1/chat/completions"): lambda: self._generate(body, chat=True),
                      ("POST", "/v1/completions"): lambda: self._generate(body, chat=False)}
            if (route := routes.get((method, path))) is None:
                if allowed := [m for m, p in routes if p == path]:
                    raise ApiError(405, f"{self.command} is not allowed on {path}, only {allowed[0]}")
                raise ApiError(404, f"Invalid URL ({method} {path})")
            route()
        except ApiError as e:
            self._send(e.status, e.body())
        except OSError:  # the client left mid-response
            self.close_connection = True
            self.log_info["client"] = "gone"
        if self.app.log:
            info = "".join(f" {k}={v:.3f}s" if isinstance(v, float) else f" {k}={v}" for k, v in self.log_info.items())
            print(f'{self.client_address[0]} "{self.command} {self.path[:200]}" {self.status}{info} '
                  f'duration={time.monotonic() - began:.3f}s', file=self.app.log, flush=True)

    do_POST = do_HEAD = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

    def _read_body(self) -> bytes:
        coding = self.headers.get("Transfer-Encoding")
        chunked = coding is not None and coding.strip().lower() == "chunked" and "Content-Length" not in self.headers
        length = int(n) if (n := self.headers.get("Content-Length", "")).isdecimal() else -1
        if len(set(self.headers.get_all("Content-Length", []))) > 1:  # which one frames the body? (smuggling)
            raise ApiError(400, "conflicting Content-Length headers")
        if not chunked and (not 0 <= length <= self.app.max_body or coding is not None):
            if coding is not None:  # another coding, or both headers (a request-smuggling pattern)
                raise ApiError(501 if "Content-Length" not in self.headers else 400,
                               f"Transfer-Encoding {coding[:50]!r}: only 'chunked', without a Content-Length")
            if length > self.app.max_body:
                # Read and drop a body of up to 8 times the limit first: a client that sends all of its
                # body before reading the answer would find the connection reset instead of the 413.
                while 0 < length <= 8 * self.app.max_body and (chunk := self.rfile.read(min(length, 1 << 20))):
                    length -= len(chunk)
                raise ApiError(413, f"the request body is over {self.app.max_body} bytes")
            raise ApiError(411, "a request body needs a valid Content-Length")
        try:
            body = self._read_chunks() if chunked else self.rfile.read(length)
        except TimeoutError:
            raise ApiError(408, f"timed out after {self.app.timeout:g}s reading the request body") from None
        if len(body) < length:  # the client closed its side before sending all of it
            raise ApiError(400, f"the request body ended after {len(body)} of its {length} bytes")
        return body

    def _read_chunks(self) -> bytes:
        """A chunked body (a streamed upload's, instead of a Content-Length): each chunk its size in hex on a line,
        then its bytes and CRLF; a chunk of size 0 and an empty line (after any trailer lines) end it."""
        body = b""
        while size := self._chunk_size():
            if len(body) + size > self.app.max_body:
                raise ApiError(413, f"the request body is over {self.app.max_body} bytes")
            data = self.rfile.read(size + 2)
            if data[size:] != b"\r\n":
                raise ApiError(400, "a chunk of the request body is cut short or not followed by CRLF")
            body += data[:size]
        while self.rfile.readline(8192).strip():  # trailer fields: read past, unused
            pass
        return body

    def _chunk_size(self) -> int:
        line = self.rfile.readline(1024).split(b";")[0].strip()  # ";name=value": chunk extensions, unused
        if not re.fullmatch(rb"[0-9a-fA-F]{1,8}", line):
            raise ApiError(400, f"malformed chunk size {line[:20]!r} in the request body")
        return int(line, 16)

    def _send(self, status: int, obj: dict | str, content_type: str = "application/json") -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
        headers = [("Content-Type", content_type), ("Content-Length", str(len(data)))]
        if status in (408, 500):  # openai's clients retry these twice unless told: it would fail the same way
            headers.append(("x-should-retry", "false"))
        if self.close_connection:
            headers.append(("Connection", "close"))
        self._head(status, headers)
        if self.command != "HEAD":
            self.wfile.write(data)

    def _head(self, status: int, headers: list[tuple[str, str]]) -> None:
        self.status = status  # for the access log
        self.send_response(status)
        for header in headers:
            self.send_header(*header)
        self.end_headers()

    def _engine(self) -> Engine:
        engine = self.app.engine
        if why := self.app.dead or (engine.failure if engine else "the model is still loading"):
            raise ApiError(503, why)
        return engine

    def _page(self) -> None:
        if (path := next((p for p in PAGES if os.path.isfile(p)), None)) is None:
            raise ApiError(404, f"page.html is not installed (looked for {' and '.join(PAGES)})")
        with open(path, encoding="utf-8") as f:
            self._send(200, f.read(), "text/html; charset=utf-8")

    def _steps(self) -> None:
        """The step events (events.py) as server-sent events from the oldest kept; a watcher that falls behind gets
        {"missed": n} and goes on from the oldest kept. While idle, a comment every second finds a watcher that left."""
        self._engine()
        if self.command == "HEAD":
            return self._open_stream()
        events = self.app.steps
        with events.cond:
            events.watchers += 1
        try:
            self._open_stream()
            last = 0
            while not (self.app.dead or self.app.stopped):
                texts, last, missed = events.read(last, 1.0)
                if missed:
                    self._event({"missed": missed})
                for text in texts:
                    self._event(text)
                if not texts:
                    self._chunk(b": idle\n\n")
            self._chunk(b"")  # the server is stopping
        finally:
            with events.cond:
                events.watchers -= 1

    def _open_stream(self) -> None:
        # HTTP/1.0 has no chunked coding: there the stream ends when the connection closes.
        self.chunked = self.request_version == "HTTP/1.1"
        self.close_connection = self.close_connection or not self.chunked
        self._head(200, [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                         ("Transfer-Encoding", "chunked") if self.chunked else ("Connection", "close")])

    def _health(self) -> None:
        self._engine()
        self._send(200, {"status": "ok"})

    def _models(self) -> None:
        max_model_len = self._engine().max_model_len
        self._send(200, {"object": "list", "data": [{"id": self.app.model_names[0], "object": "model",
                                                      "created": int(time.time()), "owned_by": "laneserve",
                                                      "max_model_len": max_model_len}]})

    def _metrics(self) -> None:
        app, s, lines = self.app, self.app.stats, []
        label = f'model_name="{app.model_names[0] if app.model_names else app.config.model}"'
        for name, kind, key, text in [
                ("num_requests_running", "gauge", "num_running", "Sequences in the running batch (vLLM's name)."),
                ("num_requests_waiting", "gauge", "num_waiting", "Sequences waiting to be scheduled."),
                ("num_requests_swapped", "gauge", "num_swapped", "Sequences swapped out to host memory."),
                ("kv_cache_usage_perc", "gauge", "kv_usage", "Fraction of KV blocks in use (1 = full)."),
                ("num_preemptions_total", "counter", "num_preemptions", "Preemptions since start."),
                ("prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens computed."),
                ("generation_tokens_total", "counter", "generation_tokens", "Tokens generated."),
                ("prefix_cache_queries_total", "counter", "prefix_cache_queries", "Prompt tokens looked up."),
                ("prefix_cache_hits_total", "counter", "prefix_cache_hits", "Prompt tokens found cached.")]:
            lines += [f"# HELP vllm:{name} {text}", f"# TYPE vllm:{name} {kind}",
                      f"vllm:{name}{{{label}}} {s.get(key, 0)}"]
        lines += ["# HELP laneserve:engine_alive 0 once the engine thread has died (see /health).",
                  "# TYPE laneserve:engine_alive gauge", f"laneserve:engine_alive{{{label}}} {int(not app.dead)}"]
        for name, hist, text in [("time_to_first_token_seconds", app.ttft, "Time to first token."),
                                 ("inter_token_latency_seconds", app.itl, "Time between tokens."),
                                 ("request_queue_time_seconds", app.queue_time, "Time waiting for a first step."),
                                 ("e2e_request_latency_seconds", app.e2e, "Time from arrival to the last token.")]:
            lines += [f"# HELP vllm:{name} {text}", f"# TYPE vllm:{name} histogram", *hist.lines(f"vllm:{name}", label)]
        self._send(200, "\n".join(lines) + "\n", "text/plain; version=0.0.4; charset=utf-8")

    def _tokenize(self, raw: bytes) -> None:
        """vLLM's /tokenize: a completion's prompt or a chat's messages, as the engine would see them."""
        engine, body = self._engine(), openai_api.parse_body(raw, self.route)
        openai_api.check_model(body, self.app.model_names)
        if "messages" in body:
            ids = openai_api.chat_prompt(body, engine, openai_api.get(body, "add_generation_prompt", bool, True))
        else:
            tok = engine.tokenizer
            if not isinstance(prompt := body.get("prompt"), str):
                raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
            add_bos = openai_api.get(body, "add_special_tokens", bool, True) and tok.add_bos_token
            ids = tok.encode(prompt, add_bos=add_bos)
        self._send(200, {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids})

    def _detokenize(self, raw: bytes) -> None:
        engine, body = self._engine(), openai_api.parse_body(raw, self.route)
        openai_api.check_model(body, self.app.model_names)
        ids, vocab = body.get("tokens"), engine.model_config.vocab_size
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise ApiError(400, f"'tokens' must be an array of token ids in [0, {vocab})", "tokens")
        self._send(200, {"prompt": engine.tokenizer.decode(ids)})

    def _next(self, replies: queue.Queue, deadline: float) -> RequestOutput | None:
        """The next reply, checking at most every 0.1 s (a syscall per token would cost the step loop
        its GIL) whether the client closed its socket: readable yet empty means it did (a pipelined
        request would make it readable, but not empty), and whether the request's deadline passed.
        Waiting for a reply, it wakes once a second, so that a thousand queued requests do not keep
        taking the GIL from the step loop (README)."""
        while True:
            if time.monotonic() > deadline:
                raise ApiError(408, f"the request took longer than --request-timeout {self.app.request_timeout:g}s")
            if time.monotonic() - self.checked > 0.1:
                if self._client_closed():  # do_GET takes any OSError, this one or a failed peek, as the client gone
                    raise ConnectionAbortedError("the client closed its connection")
                self.checked = time.monotonic()
            try:
                # Past the deadline by 10 ms, so that the check above sees it passed.
                item = replies.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.0) + 0.01))
            except queue.Empty:
                continue
            if isinstance(item, ApiError):
                raise item
            return item

    def _client_closed(self) -> bool:
        # A peek that does not wait, rather than select(), which cannot watch a descriptor numbered 1024 or
        # more (a server holding a thousand connections has them).
        self.connection.settimeout(0)
        try:
            return not self.connection.recv(1, socket.MSG_PEEK)
        except BlockingIOError:  # nothing to read: the client is there
            return False
        finally:
            self.connection.settimeout(self.timeout)

    def _event(self, obj: dict | str) -> None:
        self._chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        """A piece of a stream's body; b"" ends it."""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n" if self.chunked else data)

    def _generate(self, raw: bytes, chat: bool) -> None:
        engine, body = self._engine(), openai_api.parse_body(raw, self.route)
        n, stream, echo, usage_chunk = openai_api.reply_options(body, self.app.model_names)
        sent, prompts = (([None], [openai_api.chat_prompt(body, engine)]) if chat
                         else openai_api.completion_prompts(body, engine))
        echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if echo else "" for p in sent]
        job = Submit([(uuid.uuid4().hex, ids, openai_api.sampling_params(body, chat, len(ids), engine, i))
                      for ids in prompts for i in range(n)], queue.Queue())
        index = {rid: i for i, (rid, _, _) in enumerate(job.seqs)}
        outputs: list[list[RequestOutput]] = [[] for _ in index]
        offsets = [0] * len(index)  # where each choice's next token's text starts (completions' text_offset)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": self.app.model_names[0],
                "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"}

        def chunk(choices: list[dict]) -> dict:
            return {**head, "choices": choices, **({"usage": None} if usage_chunk else {})}

        self.app.submit(job)
        deadline = job.submitted + (self.app.request_timeout or float("inf"))
        streaming = False  # once a stream's headers are out, errors go into the stream
        try:
            self._next(job.replies, deadline)  # None once accepted; _next raises a refusal
            if stream:
                self._open_stream()
                streaming = True
            while not all(o and o[-1].finished for o in outputs):
                out = self._next(job.replies, deadline)
                i, before = index[out.request_id], outputs[index[out.request_id]]
                lps = [out.logprob] if out.logprob is not None else []
                if not any(outputs):
                    self.log_info["ttft"] = time.monotonic() - job.submitted
                if stream and chat and not before:  # OpenAI opens each choice with its role
                    self._event(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None, "stop_reason": None}]))
                if stream and echo and not before:
                    self._event(chunk([openai_api.choice(engine, chat, True, i, echoed[i // n], [], None)]))
                if stream and (out.delta or lps or out.finished):
                    choice = openai_api.choice(engine, chat, True, i, out.delta, lps, out, offsets[i])
                    self._event(chunk([choice]))
                    if not chat and lps:  # the tokens' own texts, as the whole reply counts them, not the
                        offsets[i] += sum(map(len, choice["logprobs"]["tokens"]))  # text let out (stop strings)
                before.append(out)
            prompt, completion = sum(map(len, prompts)), sum(len(o[-1].token_ids) for o in outputs)
            cached = sum(o[-1].num_cached_tokens for o in outputs[::n])  # the first choice of each prompt
            usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            self.log_info.update(prompt=prompt, output=completion)
            if usage_chunk:
                self._event({**head, "choices": [], "usage": usage})
            elif not stream:
                self._send(200, {**head, "usage": usage, "choices": [
                    openai_api.choice(engine, chat, False, i, echoed[i // n] + o[-1].text,
                            [x.logprob for x in o if x.logprob is not None], o[-1])
                    for i, o in enumerate(outputs)]})
        except ApiError as e:
            if not streaming:
                raise
            self.log_info["error"] = e.status  # the status line said 200 before the stream failed
            self._event(e.body())
        finally:
            if unfinished := [rid for rid, i in index.items() if not (outputs[i] and outputs[i][-1].finished)]:
                self.app.submit(unfinished)  # the client left or the request failed: free its KV now
        if streaming:
            self._event("[DONE]")
            self._chunk(b"")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")  # one line, not the usage block


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="serve.py", description="OpenAI-compatible server: POST /v1/chat/completions, "
                       "/v1/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics (Prometheus), "
                       "/version, /openapi.json, and / (a live page of the engine's steps).")
    a = p.add_argument
    a("--host", default="127.0.0.1",
      help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface, :: or ::1 for IPv6)")
    a("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    a("--api-key", default=os.environ.get("LANESERVE_API_KEY"),
      help="require 'Authorization: Bearer KEY' on /v1 routes (default $LANESERVE_API_KEY, else open)")
    a("--max-queue", type=int, default=1024, help="requests waiting beyond this get 429 (default 1024)")
    a("--request-timeout", type=float, help="seconds a request may take before it ends with an error and its "
      "KV is freed (default: no limit)")
    a("--served-model-name", help="the model's name in the API: /v1/models, responses, and the one requests "
      "may name (default: --model and the checkpoint's file name)")
    a("--disable-log-requests", action="store_true", help="no access-log line per request on stderr")
    a("--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help="web pages whose scripts may call the "
      "server (CORS), as scheme://host:port, or * for any (default none; vLLM's is *)")
    add_cli_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = from_cli_args(args)
        require([(0 <= args.port <= 65535, f"--port must be in [0, 65535], got {args.port}"),
                 (args.max_queue >= 1, "--max-queue must be >= 1"),
                 (args.request_timeout is None or args.request_timeout > 0, "--request-timeout must be > 0"),
                 (args.served_model_name != "", "--served-model-name must not be empty"),
                 (all(o in ("*", "null") or re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", o)
                      for o in args.allowed_origins),
                  "--allowed-origins takes scheme://host[:port] (no path), null or *")])
    except ValueError as e:
        parser.error(str(e))
    if launched_by_torchrun() and os.environ["RANK"] != "0":  # a worker of a multi-node model: rank 0 serves
        run_worker(config)
        return 0
    server = Server(config, args.host, args.port, args.api_key, args.max_queue,
                    served_model_name=args.served_model_name, request_timeout=args.request_timeout,
                    log_requests=not args.disable_log_requests, allowed_origins=tuple(args.allowed_origins))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"laneserve: loading {args.model} (/health answers 503 until it is ready) ...", file=sys.stderr)
    began = time.monotonic()
    try:
        server.start()
    except OSError as e:
        print(f"serve.py: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        while not stop.is_set() and not server.wait_ready(0.5):
            pass
    except RuntimeError as e:
        server.stop()
        print(f"serve.py: error: {e}", file=sys.stderr)
        return 1
    if not stop.is_set():
        e, bm = server.engine, server.engine.block_manager
        kv_tokens = bm.num_blocks * bm.block_size
        print(f"laneserve: {server.model_names[0]} on {e.device} {str(e.dtype).removeprefix('torch.')}, "
              f"KV {bm.num_blocks} blocks = {kv_tokens} tokens, max concurrency {config.max_num_seqs} requests "
              f"({kv_tokens / e.max_model_len:.2f}x at the full {e.max_model_len}-token context), "
              f"ready in {time.monotonic() - began:.1f}s, serving {server.url}", file=sys.stderr)
        if e.sampling_defaults:
            print(f"laneserve: requests default to the checkpoint's generation_config.json: {e.sampling_defaults}",
                  file=sys.stderr)
        stop.wait()
    print("laneserve: stopping", file=sys.stderr)
    if server.engine is None:
        # torch cannot be interrupted mid-load, and finalizing the interpreter under it aborts the process.
        sys.stderr.flush()
        os._exit(0)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
