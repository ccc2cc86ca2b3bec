"""The step loop: requests in, one scheduled forward pass per step, tokens out."""

from __future__ import annotations

import random
import secrets
import time
import uuid
from dataclasses import dataclass, replace

import torch

import weights
from config import EngineConfig
from kv_cache import BlockManager
from parallel import WorkerFailure
from runner import ModelRunner
from sampler import Sampled, TokenLogprob
from scheduler import Scheduler
from sequence import SamplingParams, Sequence, Status, require
from speculation import settle
from structured import Grammars
from tokenizer import IncrementalDetokenizer, byte_tokenizer, load_tokenizer, read_chat_template


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str  # text released by this step
    finished: bool
    finish_reason: str | None  # "stop" or "length", as in OpenAI's API; "error" when error is set
    logprob: TokenLogprob | None = None  # of the token this step produced, when asked for
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    queue_time: float | None = None  # seconds it waited for its first step
    error: str | None = None  # why this request alone failed (its sampling or detokenizing raised)
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token (not EOS) that ended it
    prompt_logprobs: list[TokenLogprob] | None = None  # of prompt tokens 1, 2, ..., when asked for


class Engine:
    """The step loop, on one thread. It owns the requests in flight (`requests`: request id -> Sequence), the
    scheduler and the KV block pool it schedules from, the runner (model, KV cache, tensor-parallel ranks), the
    tokenizer, the counters of /metrics, and each step's record of drafts (`verified`). add_request and abort
    between steps; step() runs one."""

    def __init__(self, config: EngineConfig | str | None = None, **kwargs):
        # Keyword arguments set knobs, over config's if both are given. A string names the model, as vLLM's LLM("...").
        if isinstance(config, str):
            config, kwargs["model"] = None, config
        self.config = c = replace(config, **kwargs) if config else EngineConfig(**kwargs)
        if c.torch_threads:
            torch.set_num_threads(c.torch_threads)
        # Read before the weights: a bad template file fails at once, not after minutes of loading.
        template = read_chat_template(c.chat_template) if c.chat_template else None
        self.runner = r = ModelRunner(c)
        self.device, self.dtype, self.model_config = r.device, r.dtype, r.model_config
        self.quantization = r.quantization
        self.max_model_len, self.checkpoint_path = r.max_model_len, r.checkpoint_path
        self.tokenizer = (
            byte_tokenizer(self.model_config.vocab_size) if c.dummy_weights else load_tokenizer(r.checkpoint_path)
        )
        if template:
            self.tokenizer = self.tokenizer.with_chat_template(template)
        weights.read_gguf.cache_clear()  # the parsed header, vocabulary included, was the tokenizer's
        # The checkpoint's generation_config.json, else the model card's for a preset found by its name.
        auto = c.generation_config == "auto"
        card = weights.CARD_SAMPLING.get(c.model, {}) if auto and not (c.model_path or c.dummy_weights) else {}
        found = weights.sampling_defaults(r.checkpoint_path) if auto else {}
        self.sampling_defaults = found or dict(card)
        self.sampling_source = "generation_config.json" if found else "model card" if self.sampling_defaults else None
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.block_manager = BlockManager(r.num_kv_blocks, c.block_size, c.enable_prefix_caching)
        self.scheduler = Scheduler(c, self.block_manager, BlockManager(r.num_swap_blocks, c.block_size))
        self.requests: dict[str, Sequence] = {}
        self.rng = random.Random(c.seed)
        self.on_step = None  # called after each step with (engine, SchedulerOutput, outputs, seconds): events.py
        self.verified = {}  # this step's drafts: request id -> (drafted, accepted)
        self.held: list[RequestOutput] = []  # static mode: finished, waiting for the batch to end
        # Prompt tokens run through the model (cache hits excluded), generated tokens, and speculation's draft tokens
        # proposed and accepted.
        self.num_prompt_tokens = self.num_generation_tokens = self.num_draft_tokens = self.num_accepted_tokens = 0

    def stats(self) -> dict[str, float]:
        """Counters and gauges for the server's /metrics."""
        s, bm = self.scheduler, self.block_manager
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            "kv_usage": 1 - bm.num_free_blocks / bm.num_blocks,
            "num_kv_blocks": bm.num_blocks,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_queries,
            "prefix_cache_hits": s.prefix_hits,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "spec_decode_draft_tokens": self.num_draft_tokens,
            "spec_decode_accepted_tokens": self.num_accepted_tokens,
        }

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it joins the running batch at the next step with room for it."""
        params = SamplingParams(**self.sampling_defaults) if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if self.config.prefix_cache_isolation and params.cache_salt is None:  # a salt nobody else can guess
            params = replace(params, cache_salt=secrets.token_hex(16))
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt, add_bos=self.tokenizer.add_bos_token)
        if not (isinstance(prompt, (list, tuple)) and all(type(t) is int for t in prompt)):
            raise ValueError(f"a prompt is a string or a list of token ids (Python ints), got {prompt!r:.80}")
        ids = list(prompt)
        c, vocab, pool = self.config, self.model_config.vocab_size, self.block_manager.num_blocks
        blocks = -(-(len(ids) + params.max_tokens) // c.block_size)
        request_id = uuid.uuid4().hex if request_id is None else request_id
        require(
            [
                (bool(ids), "prompt is empty"),
                (isinstance(request_id, str) and request_id != "", "request_id must be a non-empty string"),
                (all(0 <= t < vocab for t in ids), f"token ids must be in [0, {vocab})"),
                (
                    all(0 <= t < vocab for t in [*params.logit_bias, *params.stop_token_ids]),
                    f"logit_bias and stop_token_ids take token ids in [0, {vocab})",
                ),
                (
                    len(ids) + params.max_tokens <= self.max_model_len,
                    f"prompt ({len(ids)} tokens) + max_tokens "
                    f"({params.max_tokens}) exceeds max_model_len ({self.max_model_len})",
                ),
                (blocks <= pool, f"prompt + max_tokens needs {blocks} KV blocks; the pool has only {pool}"),
                (
                    c.enable_chunked_prefill or len(ids) <= c.max_num_batched_tokens,
                    f"prompt ({len(ids)} tokens) "
                    f"exceeds max_num_batched_tokens ({c.max_num_batched_tokens}) with chunked prefill off",
                ),
                (request_id not in self.requests, f"duplicate request id {request_id!r}"),
            ]
        )
        seq = Sequence(request_id, ids, params)
        seq.seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        if params.structured_outputs is not None:  # compiled here: a grammar that does not compile is a ValueError
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        eos = set() if params.ignore_eos else self.tokenizer.stop_token_ids
        seq.stop_ids = frozenset(params.stop_token_ids) | eos
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:  # not finished yet
            self._finish(self.requests[request_id])
        self.held = [o for o in self.held if o.request_id != request_id]  # static mode: finished, not yet out

    @property
    def failure(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel worker died), else None."""
        return self.runner.tp.failure if self.runner.tp else None

    def close(self) -> None:
        """End the tensor-parallel workers, if any (also done at exit)."""
        if self.runner.tp:
            self.runner.tp.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.held)

    def step(self) -> list[RequestOutput]:
        """schedule -> run the model (batch tensors, forward, sample) -> append the tokens. Returns an
        output for every sequence that produced a token this step (static mode: finished ones held until
        their batch ends)."""
        began = time.perf_counter()
        if self.failure:
            raise WorkerFailure(self.failure)
        # Static mode: aborts ended the batch; what it held goes out before the next batch starts.
        ended, self.held = (self.held, []) if self.held and not self.scheduler.running else ([], self.held)
        out = self.scheduler.schedule()
        sampled = self.runner.run(out.scheduled, out.swap_out, out.swap_in)
        if not out.scheduled:
            return ended
        for seq, n in out.scheduled:
            if seq.queue_time is None:
                seq.queue_time = time.monotonic() - seq.arrival_time
            begin, prompt_end = seq.num_computed_tokens, min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
            self.num_prompt_tokens += max(0, prompt_end - begin)
            self.block_manager.publish(seq.block_table, seq.token_ids, begin, prompt_end, seq.params.cache_salt)
            seq.num_computed_tokens += n - len(seq.draft)  # a draft's K/V counts once verified
        self.verified = {}
        outputs = [o for r in sampled for o in self._emit(r)]
        if self.on_step:
            self.on_step(self, out, outputs, time.perf_counter() - began)
        if self.config.scheduling == "static":
            # Request-level batching answers a batch all at once: a finished sequence's result waits
            # (its place in the batch idle) until the batch's longest sequence is done.
            self.held += [o for o in outputs if o.finished]
            outputs = [o for o in outputs if not o.finished]
            if not self.scheduler.running:
                outputs, self.held = outputs + self.held, []
        return ended + outputs

    def _emit(self, r: Sampled) -> list[RequestOutput]:
        """A sampled sequence's tokens: its next, then each draft row's while the token before agreed with that draft
        (whose K/V then counts as computed), until it finishes."""
        seq, draft, outputs = r.seq, r.seq.draft, []
        seq.prompt_logprobs += r.prompt_logprobs
        for j, token in enumerate(r.token_ids):
            if j and (seq.status is Status.FINISHED or r.token_ids[j - 1] != draft[j - 1]):
                break
            seq.num_computed_tokens += j > 0
            outputs.append(
                self._fail(seq, r.errors[j]) if r.errors[j] else self._append_token(seq, token, r.logprobs[j])
            )
        if draft:
            drafted, accepted = self.verified[seq.request_id] = settle(
                seq, len(outputs) - 1, self.block_manager, self.config.block_size
            )
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        if seq.grammar and not seq.grammar.accept(token):  # another rule (min_tokens, a bias) banned all it allows
            return self._fail(seq, "no token is allowed by both the grammar and the request's other rules")
        seq.token_ids.append(token)
        self.num_generation_tokens += 1
        delta, reason, stop_reason = "", None, None
        if token in seq.stop_ids:
            reason, stop_reason = "stop", None if token == self.tokenizer.eos_id else token
        else:  # an ignored EOS too: its text goes out unless skip_special_tokens (the default) drops it
            try:
                # As in vLLM, stop strings count from min_tokens on, like stop tokens.
                delta = seq.detokenizer.feed(token, len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.min_tokens)
            except Exception as e:  # a tokenizer bug fails this request, not its neighbours
                return self._fail(seq, f"detokenizing failed ({type(e).__name__}: {e})")
            reason = "stop" if seq.detokenizer.stopped or seq.grammar and seq.grammar.done else None
        if reason is None and (
            len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if not seq.detokenizer.stopped:  # release text held back as a possible stop-string start
                delta += seq.detokenizer.flush()
                reason = "stop" if seq.detokenizer.stopped else reason  # the last character completed one
            self._finish(seq)
        stopped = seq.detokenizer.stopped
        return self._output(seq, delta, reason, logprob, None, stopped if stop_reason is None else stop_reason)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self._finish(seq)
        return self._output(seq, "", "error", None, error)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        del self.requests[seq.request_id]

    def _output(
        self,
        seq: Sequence,
        delta: str,
        reason: str | None,
        logprob: TokenLogprob | None,
        error: str | None = None,
        stop_reason: int | str | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            seq.request_id,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.output_token_ids,
            seq.detokenizer.text,
            delta,
            reason is not None,
            reason,
            logprob,
            seq.num_cached_tokens,
            seq.queue_time,
            error,
            stop_reason,
            seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
        )


class LLM(Engine):
    """Offline use: generate() and chat() run every request to completion, batched as the engine schedules."""

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or isinstance(prompts, list) and prompts and type(prompts[0]) is int:
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise ValueError(
                f"prompts: a string, a list of token ids, or a list of those; got {type(prompts).__name__}"
            )
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)  # None: add_request's defaults
        require(
            [
                (
                    len(sampling_params) == len(prompts),
                    f"{len(prompts)} prompts but {len(sampling_params)} sampling params",
                ),
                # Its step loop would take their outputs, which the caller of add_request expects from step().
                (
                    not self.has_unfinished(),
                    "generate() runs alone: finish (step) or abort the requests added with add_request first",
                ),
            ]
        )
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for p, sp in zip(prompts, sampling_params):
                ids.append(self.add_request(p, sp))
            while len(done) < len(ids):
                done |= {out.request_id: out for out in self.step() if out.finished}
        except BaseException:  # a bad prompt, or Ctrl-C mid-run: no request of this call stays queued, unseen
            for i in ids:
                self.abort(i)
            raise
        return [done[i] for i in ids]

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not isinstance(conversations, list):  # each conversation is checked by the template's renderer
            raise ValueError("conversations: a list of messages, or a list of those")
        return self.generate([self.tokenizer.apply_chat_template(m) for m in conversations], sampling_params)
