"""The engine on its own thread, for a server's request threads. The engine is not thread-safe, so they never
touch it: they post to the thread's inbox (a Submit, or request ids to abort) and read outputs from their own
queue. The thread drains the inbox between steps and only ever puts to unbounded queues, so no client can
stall a step; it times each sequence's tokens for /metrics."""

from __future__ import annotations

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from config import EngineConfig
from engine import Engine, SamplingParams
from parallel import WorkerFailure
from server import openai_api
from server.errors import ApiError
from server.events import StepEvents
from server.metrics import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, Histogram


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


class EngineLoop:
    """The Engine on a thread of its own, for the server's request threads. It owns the engine (once loaded), the
    inbox of Submits and aborts (drained between steps), each request's Stream (its reply queue), the step events
    for watchers, the latency histograms, and why the engine died if it did; the request threads touch nothing
    else."""

    def __init__(self, config: EngineConfig, max_queue: int = 1024, served_model_name: str | list[str] | None = None):
        self.config, self.max_queue, self.served_model_name = config, max_queue, served_model_name
        self.engine: Engine | None = None  # set once loaded
        self.model_names: list[str] = []  # the name replies carry first, then others a request may use
        self.stats: dict[str, float] = {}  # the engine's, snapshot by its thread: it alone may read the engine
        self.ttft, self.itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self.queue_time, self.e2e = Histogram(REQUEST_BUCKETS), Histogram(REQUEST_BUCKETS)
        self.steps = StepEvents()  # what /v1/engine/steps streams to the live page
        self.dead: str | None = None  # why the engine thread ended (it died, or the server stops)
        self._inbox: queue.Queue[Submit | list[str] | None] = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        """The model loads on the engine thread; wait_ready waits for it."""
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the model is loaded; RuntimeError if loading failed."""
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise RuntimeError(str(self._load_error)) from self._load_error
        return self._ready.is_set()

    def stop(self) -> None:
        self._inbox.put(None)
        if self._ready.is_set():  # a load in progress cannot be interrupted; its daemon thread dies with us
            self._thread.join(timeout=30)

    def submit(self, item: Submit | list[str]) -> None:
        """Sequences to add, or request ids to abort; any thread."""
        self._inbox.put(item)
        if self.dead:  # nobody else will answer it: whichever of us drains after `dead` is set does
            self._refuse_inbox([])

    def _refuse_inbox(self, items: list) -> None:
        """Answer every request in items (taken from the inbox) or still in the inbox with a 503 saying why the engine
        ended (it died, or the server stops)."""
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, Submit):  # an accepted one reads this after its None, and stops there
                item.replies.put(ApiError(503, self.dead))

    def _run(self) -> None:
        c = self.config
        try:
            engine = Engine(c)
            engine.on_step = self.steps.publish
            self.model_names = openai_api.model_names(c.model, engine.checkpoint_path, self.served_model_name)
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
            self.dead = (
                str(e)
                if isinstance(e, WorkerFailure)
                else f"the engine thread died ({type(e).__name__}: {e}); restart the server"
            )
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
        self.dead = "the server is shutting down"  # from now on a request is refused at once, not left waiting
        for stream in streams.values():
            stream.replies.put(ApiError(503, self.dead))
        self._refuse_inbox([item for item in items if item is not None])  # those taken with stop()'s None

    def _add(self, job: Submit, streams: dict[str, Stream]) -> ApiError | None:
        """Adds all of job's sequences and returns None, or adds none and returns why."""
        s, c = self.engine.stats(), self.config
        # The next step admits sequences into the batch's free places (KV allowing), so only those beyond wait;
        # nothing is admitted while any is swapped out, or while a static batch runs.
        busy = s["num_swapped"] or c.scheduling == "static" and s["num_running"]
        free = 0 if busy else c.max_num_seqs - s["num_running"]
        waiting = s["num_waiting"] + s["num_swapped"]
        if len(job.seqs) > self.max_queue + c.max_num_seqs:  # never accepted: a 429 would have the client retry
            return ApiError(
                400,
                f"this request has {len(job.seqs)} sequences (prompts times n), more than the "
                f"server takes (--max-num-seqs {c.max_num_seqs} plus --max-queue {self.max_queue})",
            )
        if waiting + len(job.seqs) - free > self.max_queue:
            return ApiError(
                429,
                f"{waiting} sequences are waiting (--max-queue {self.max_queue}); retry later",
                code="rate_limit_exceeded",
            )
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
