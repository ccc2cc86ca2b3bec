"""The OpenAI-compatible server: its routes, the server that puts together the HTTP front (http11.py) and the
engine's thread (engine_loop.py), and the command line. What the API's fields mean and how replies are shaped
is openai_api.py's."""

from __future__ import annotations

import dataclasses
import errno
import hmac
import importlib.metadata
import os
import queue
import re
import signal
import sys
import threading
import time
import uuid

import cpu
import server
from cli import ArgumentParser, add_cli_args, from_cli_args
from config import DEFAULT_MODEL, EngineConfig
from engine import Engine, RequestOutput
from parallel import launched_by_torchrun
from runner import run_worker
from sequence import require
from server import metrics, openai_api
from server.engine_loop import EngineLoop, Submit
from server.errors import ApiError
from server.http11 import HTTPServer, RequestHandler
from weights import PRESETS

# The live page at /: package data of `server`, in a checkout and once pip-installed alike.
PAGE = os.path.join(os.path.dirname(os.path.abspath(server.__file__)), "page.html")


class Server(EngineLoop):
    """The engine loop behind HTTP: each connection on its own thread, its requests answered by Handler."""

    def __init__(
        self,
        config: EngineConfig,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        max_queue: int = 1024,
        served_model_name: str | list[str] | None = None,
        request_timeout: float | None = None,
        log_requests: bool = True,
        allowed_origins: tuple[str, ...] = (),
    ):
        super().__init__(config, max_queue, served_model_name)
        self.host, self.port, self.api_key = host, port, api_key
        self.request_timeout = request_timeout  # seconds from submission; the request then ends, its KV freed
        self.timeout = 30.0  # per-connection socket timeout: a stalled client holds only its own thread
        self.max_body = 8 * 2**20  # bytes
        self.allowed_origins = allowed_origins  # web pages (scheme://host:port, or "*") whose scripts may call us
        self.log = sys.stderr if log_requests else None  # one access-log line per request
        self.stopped = False
        self._httpd: HTTPServer | None = None

    def start(self) -> None:
        """Bind and serve at once; the model loads on the engine thread (/health answers 503 until then)."""
        self._httpd = HTTPServer((self.host, self.port), Handler, self)
        self.port = self._httpd.server_address[1]
        host = self.host or "0.0.0.0"  # "" binds every interface too
        self.url = f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"
        # serve_forever looks for stop()'s shutdown between polls: every 50 ms rather than its default 500.
        threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="http", daemon=True).start()
        super().start()

    def stop(self) -> None:
        self.stopped = True
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._accept_backlog()
        self._httpd.server_close()
        super().stop()
        # The request threads die with the process: let them write the answers they hold (the 503s too).
        with self._httpd.handling_changed:
            self._httpd.handling_changed.wait_for(lambda: not self._httpd.handling, timeout=5)

    def _accept_backlog(self) -> None:
        """Connections the kernel took before the listener closes each get a thread, so an answer (a 503 once the
        engine has stopped) rather than a reset."""
        self._httpd.socket.setblocking(False)
        while True:
            try:
                request, address = self._httpd.socket.accept()
            except OSError:
                return
            self._httpd.process_request(request, address)


def version() -> str:
    try:
        return importlib.metadata.version("laneserve")
    except importlib.metadata.PackageNotFoundError:  # a checkout pip never installed
        return "unknown"


class Handler(RequestHandler):
    """The routes."""

    app: Server

    def route(self, method: str, path: str, body: bytes) -> None:
        if (
            path.startswith("/v1/")
            and self.app.api_key
            and not hmac.compare_digest(
                self.headers.get("Authorization", "").encode("latin-1"), f"Bearer {self.app.api_key}".encode()
            )
        ):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        routes = {
            ("GET", "/"): self._page,
            ("GET", "/v1/engine/steps"): self._steps,
            ("GET", "/health"): self._health,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/version"): lambda: self._send(200, {"version": version()}),
            ("GET", "/openapi.json"): lambda: self._send(200, openai_api.openapi(version())),
            ("POST", "/tokenize"): lambda: self._tokenize(body),
            ("POST", "/detokenize"): lambda: self._detokenize(body),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/chat/completions"): lambda: self._generate(body, chat=True),
            ("POST", "/v1/completions"): lambda: self._generate(body, chat=False),
        }
        if (route := routes.get((method, path))) is None:
            if allowed := [m for m, p in routes if p == path]:
                allow = [("Allow", ", ".join(allowed + ["HEAD"] * (allowed == ["GET"])))]  # HEAD is GET's
                raise ApiError(405, f"{self.command} is not allowed on {path}, only {allowed[0]}", headers=allow)
            # Most often an OpenAI client's base_url without its /v1 (or /v1 where vLLM has none, as /health).
            if near := next(
                (p for m, p in routes if m == method and p in ("/v1" + path, path.removeprefix("/v1"))), None
            ):
                base = f" (an OpenAI client's base_url ends in /v1: {self.app.url}/v1)" if near[:4] == "/v1/" else ""
                raise ApiError(404, f"Invalid URL ({method} {path}): did you mean {near}?{base}")
            raise ApiError(404, f"Invalid URL ({method} {path})")
        route()

    def _engine(self) -> Engine:
        engine = self.app.engine
        if why := self.app.dead or (engine.failure if engine else "the model is still loading"):
            raise ApiError(503, why)
        return engine

    def _page(self) -> None:
        if not os.path.isfile(PAGE):
            raise ApiError(404, f"page.html is not installed (looked for {PAGE})")
        with open(PAGE, encoding="utf-8") as f:
            self._send(200, f.read(), "text/html; charset=utf-8")

    def _steps(self) -> None:
        """The step events (events.py) as server-sent events from the next step on; a watcher that falls behind gets
        {"missed": n} and goes on from the oldest kept. While idle, a comment every second finds a watcher that left."""
        self._engine()
        if self.command == "HEAD":
            return self._open_stream()
        events = self.app.steps
        last = events.start()
        try:
            self._open_stream()
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
            events.stop()

    def _health(self) -> None:
        self._engine()
        self._send(200, {"status": "ok"})

    def _models(self) -> None:
        max_model_len, created = self._engine().max_model_len, int(time.time())
        self._send(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "laneserve",
                        "max_model_len": max_model_len,
                    }
                    for name in self.app.model_names
                ],
            },
        )

    def _metrics(self) -> None:
        app = self.app
        text = metrics.prometheus_text(
            app.model_names[0] if app.model_names else app.config.model,
            app.stats,
            not app.dead,
            app.ttft,
            app.itl,
            app.queue_time,
            app.e2e,
            app.config.block_size,
            app.config.kv_cache_dtype,
        )
        self._send(200, text, metrics.CONTENT_TYPE)

    def _tokenize(self, raw: bytes) -> None:
        """vLLM's /tokenize: a completion's prompt or a chat's messages, as the engine would see them."""
        engine, body = self._engine(), openai_api.parse_body(raw, "/tokenize")
        openai_api.check_model(body, self.app.model_names)
        if body.get("messages") is not None and body.get("prompt") is not None:
            raise ApiError(400, "send 'prompt' or 'messages', not both", "messages")
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
        engine, body = self._engine(), openai_api.parse_body(raw, "/detokenize")
        openai_api.check_model(body, self.app.model_names)
        ids, vocab = body.get("tokens"), engine.model_config.vocab_size
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < vocab for t in ids)):
            raise ApiError(400, f"'tokens' must be an array of token ids in [0, {vocab})", "tokens")
        self._send(200, {"prompt": engine.tokenizer.decode(ids)})

    def _next(self, replies: queue.Queue, deadline: float) -> RequestOutput | None:
        """The next reply, unless the client has gone or the request's deadline passed. Waiting, it wakes once a
        second, so that a thousand queued requests do not keep taking the GIL from the engine thread."""
        while True:
            if time.monotonic() > deadline:
                raise ApiError(408, f"the request took longer than --request-timeout {self.app.request_timeout:g}s")
            if self._client_closed():  # _answer takes any OSError, this one or a failed peek, as the client gone
                raise ConnectionAbortedError("the client closed its connection")
            try:
                # Past the deadline by 10 ms, so that the check above sees it passed.
                item = replies.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.0) + 0.01))
            except queue.Empty:
                continue
            if isinstance(item, ApiError):
                raise item
            return item

    def _generate(self, raw: bytes, chat: bool) -> None:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        engine, body = self._engine(), openai_api.parse_body(raw, route)
        n, stream, echo, usage_chunk, continuous = openai_api.reply_options(body, self.app.model_names)
        continuous &= usage_chunk  # as vLLM: continuous_usage_stats counts along with include_usage
        sent, prompts = (
            ([None], [openai_api.chat_prompt(body, engine)]) if chat else openai_api.completion_prompts(body, engine)
        )
        echoed = [(p if isinstance(p, str) else engine.tokenizer.decode(p)) if echo else "" for p in sent]
        echo_logprobs = echo and body.get("logprobs") is not None  # the echoed prompt's tokens carry logprobs
        scoring_only = echo and body.get("max_tokens") == 0  # its one generated token is not reported
        asked_prompt_logprobs = body.get("prompt_logprobs") is not None
        # Tool calls: the reply's text is parsed when finished; while streamed, text that may be a call is held back.
        calling = openai_api.tool_choice(body) if chat else None
        names = [t["function"]["name"] for t in openai_api.tools(body) or []] if chat else []
        job = Submit(
            [
                (uuid.uuid4().hex, ids, openai_api.sampling_params(body, chat, len(ids), engine, i))
                for ids in prompts
                for i in range(n)
            ],
            queue.Queue(),
        )
        index = {rid: i for i, (rid, _, _) in enumerate(job.seqs)}
        outputs: list[list[RequestOutput]] = [[] for _ in index]
        offsets = [openai_api.TextOffsets() for _ in index]  # completions' text_offset, choice by choice
        shown, held = [0] * len(index), [[] for _ in index]  # per choice: text streamed, logprobs not yet streamed
        head = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": self.app.model_names[0],
            "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
        }

        prompt = sum(map(len, prompts))

        def chunk(choices: list[dict]) -> dict:
            if continuous:  # vLLM's continuous_usage_stats: every chunk carries the usage so far
                made = sum(map(len, outputs))
                return {**head, "choices": choices, "usage": usage_of(prompt, made)}
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
                if scoring_only:
                    out = dataclasses.replace(out, token_ids=[], text="", delta="", logprob=None)
                i, before = index[out.request_id], outputs[index[out.request_id]]
                first = not before
                before.append(out)  # counted by a continuous usage from this chunk on
                lps = [out.logprob] if out.logprob is not None else []
                if sum(map(len, outputs)) == 1:
                    self.log_info["ttft"] = time.monotonic() - job.submitted
                if stream and chat and first:  # OpenAI opens each choice with its role
                    self._event(
                        chunk(
                            [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "stop_reason": None,
                                }
                            ]
                        )
                    )
                if stream and echo and first:
                    prompt_lps = openai_api.echoed_logprobs(out) if echo_logprobs else []
                    choice = openai_api.choice(engine, chat, True, i, echoed[i // n], prompt_lps, None, offsets[i])
                    self._event(chunk([choice]))
                lps = held[i] = held[i] + lps
                if stream and not out.finished and openai_api.maybe_call(out.text, calling):
                    continue  # held back, text and logprobs, until it is a call or turns out to be text
                if stream and (out.delta or lps or out.finished):
                    calls = openai_api.parse_calls(out.text, calling, names) if out.finished else []
                    text = out.text[shown[i] :] if calling else out.delta
                    choice = openai_api.choice(engine, chat, True, i, text, lps, out, offsets[i], calls)
                    shown[i], held[i] = len(out.text), []
                    self._event(chunk([choice]))
            completion = sum(len(o[-1].token_ids) for o in outputs)
            cached = sum(o[-1].num_cached_tokens for o in outputs[::n])  # the first choice of each prompt
            usage = {**usage_of(prompt, completion), "prompt_tokens_details": {"cached_tokens": cached}}
            self.log_info.update(prompt=prompt, output=completion)
            if usage_chunk:
                self._event({**head, "choices": [], "usage": usage})
            elif not stream:
                choices = [
                    openai_api.choice(
                        engine,
                        chat,
                        False,
                        i,
                        echoed[i // n] + o[-1].text,
                        (openai_api.echoed_logprobs(o[-1]) if echo_logprobs else [])
                        + [x.logprob for x in o if x.logprob is not None],
                        o[-1],
                        calls=openai_api.parse_calls(o[-1].text, calling, names),
                    )
                    for i, o in enumerate(outputs)
                ]
                scored = [openai_api.prompt_logprobs(engine, o[-1]) if asked_prompt_logprobs else None for o in outputs]
                # vLLM's places: each completion choice's, a chat reply's (its one prompt)
                choices = [c | ({} if chat else {"prompt_logprobs": p}) for c, p in zip(choices, scored)]
                reply = {**head, "usage": usage, "choices": choices}
                self._send(200, reply | ({"prompt_logprobs": scored[0]} if chat else {}))
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


def usage_of(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _parser(prog: str = "serve.py") -> ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="OpenAI-compatible server: POST /v1/chat/completions, "
        "/v1/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics (Prometheus), "
        "/version, /openapi.json, and / (a live page of the engine's steps).",
    )
    a = p.add_argument
    a(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface, :: or ::1 for IPv6)",
    )
    a("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    a(
        "--api-key",
        default=os.environ.get("LANESERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default $LANESERVE_API_KEY, else open)",
    )
    a(
        "--max-queue",
        type=int,
        default=1024,
        help="sequences (prompts times n) waiting beyond this get 429 (default 1024)",
    )
    a(
        "--request-timeout",
        type=float,
        help="seconds a request may take before it ends with an error and its KV is freed (default: no limit)",
    )
    a(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the model's names in the API, the first in replies "
        "(default: --model, the preset's Hugging Face id, and the checkpoint's file name)",
    )
    a("--disable-log-requests", action="store_true", help="no access-log line per request on stderr")
    a(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="web pages whose scripts may call the "
        "server (CORS), as scheme://host:port, or * for any (default none; vLLM's is *)",
    )
    a("--version", action="version", version=f"laneserve {version()}")
    a("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's `vllm serve MODEL`)")
    a("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines: no remote code runs here")
    a(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM's command lines: no periodic stats are logged",
    )
    add_cli_args(p)
    p.set_defaults(model=None)  # so that main() tells --model given from --model left out (EngineConfig's default)
    p.epilog = "presets for --model: " + ", ".join(PRESETS)
    return p


def sampling_note(engine: Engine, config: EngineConfig) -> str:
    """What requests that leave the sampling fields out get, and where it comes from (Engine.sampling_source)."""
    head = "requests that leave sampling fields out get"
    if engine.sampling_source:
        given = ", ".join(f"{k} {v}" for k, v in engine.sampling_defaults.items())
        source = (
            "the checkpoint's generation_config.json"
            if engine.sampling_source == "generation_config.json"
            else f"the model card's advice for {config.model} (weights.CARD_SAMPLING), as the checkpoint has "
            "no generation_config.json"
        )
        return f"{head} {given}: {source}; --generation-config vllm for OpenAI's defaults instead"
    why = (
        "--generation-config vllm"
        if config.generation_config == "vllm"
        else "the checkpoint has no "
        "generation_config.json, and a model card's advice applies only to a preset's real weights named by --model"
    )
    return f"{head} OpenAI's defaults (temperature 1, top_p 1): {why}"


def main(argv: list[str] | None = None, prog: str = "serve.py") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.model_tag and args.model not in (None, args.model_tag):
        parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    if args.trust_remote_code:
        print("laneserve: --trust-remote-code changes nothing: no checkpoint's code runs here", file=sys.stderr)
    try:
        config = from_cli_args(args)
        require(
            [
                (0 <= args.port <= 65535, f"--port must be in [0, 65535], got {args.port}"),
                (args.max_queue >= 1, "--max-queue must be >= 1"),
                (args.request_timeout is None or args.request_timeout > 0, "--request-timeout must be > 0"),
                (all(args.served_model_name or ["-"]), "--served-model-name must not be empty"),
                (
                    all(
                        o in ("*", "null") or re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", o)
                        for o in args.allowed_origins
                    ),
                    "--allowed-origins takes scheme://host[:port] (no path), null or *",
                ),
            ]
        )
    except ValueError as e:
        parser.error(str(e))
    if launched_by_torchrun() and os.environ["RANK"] != "0":  # a worker of a multi-node model: rank 0 serves
        run_worker(config)
        return 0
    server = Server(
        config,
        args.host,
        args.port,
        args.api_key,
        args.max_queue,
        served_model_name=args.served_model_name,
        request_timeout=args.request_timeout,
        log_requests=not args.disable_log_requests,
        allowed_origins=tuple(args.allowed_origins),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"laneserve: loading {args.model} (/health answers 503 until it is ready) ...", file=sys.stderr)
    began = time.monotonic()
    try:
        server.start()
    except OSError as e:
        hint = {
            errno.EADDRINUSE: f"; another process has it: --port {args.port + 1}, or --port 0 for any free port",
            errno.EACCES: "; ports below 1024 need privileges: --port 8000, or --port 0 for any free port",
            errno.EADDRNOTAVAIL: "; --host takes an address of this machine, such as 127.0.0.1 or 0.0.0.0",
        }
        print(
            f"serve.py: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}{hint.get(e.errno, '')}",
            file=sys.stderr,
        )
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
        kv_tokens, dtype = bm.num_blocks * bm.block_size, str(e.dtype).removeprefix("torch.")
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        whole = bm.num_blocks // -(-e.max_model_len // bm.block_size)  # requests of max_model_len tokens it holds
        if whole == 0:  # as vLLM: a server that cannot serve one full request does not start
            server.stop()
            print(
                f"serve.py: error: the KV pool holds {kv_tokens} tokens, less than one request of the full "
                f"{e.max_model_len}-token context: lower --max-model-len (to {kv_tokens} at most), or give the KV "
                "cache more memory (--kv-cache-memory on CPU, --gpu-memory-utilization on GPU, --num-kv-blocks)",
                file=sys.stderr,
            )
            return 1
        print(
            f"laneserve: {server.model_names[0]} on {e.device} {dtype}, KV {bm.num_blocks} blocks = {kv_tokens} "
            f"tokens ({kv_dtype}): room for {whole} request{'s' * (whole != 1)} of the full "
            f"{e.max_model_len}-token context, more of shorter ones (at most {config.max_num_seqs} run at once); "
            f"ready in {time.monotonic() - began:.1f}s, serving {server.url}",
            file=sys.stderr,
        )
        if e.device.type == "cpu":
            print(f"laneserve: {cpu.choices(e.dtype, e.quantization, config.dtype != 'auto')}", file=sys.stderr)
        print(f"laneserve: {sampling_note(e, config)}", file=sys.stderr)
        # With a timeout: a signal the kernel hands to another thread only wakes the main thread's wait here.
        while not stop.wait(0.5):
            pass
    print("laneserve: stopping", file=sys.stderr)
    if server.engine is None:
        # torch cannot be interrupted mid-load, and finalizing the interpreter under it aborts the process.
        sys.stderr.flush()
        os._exit(0)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
