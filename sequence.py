"""A sequence (a lane): one stream of tokens the engine runs, with its sampling parameters and state."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def require(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def typed(name: str, value: Any, kind: type, none_ok: bool = False) -> tuple[bool, str]:
    """A check for require: value is a kind (an int does for a float, a bool for neither), or None if allowed."""
    return (
        type(value) is kind or kind is float and type(value) is int or none_ok and value is None,
        f"{name} must be {kind.__name__}, got {value!r}",
    )


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # ... and this times how often it was generated
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # vLLM's: the same for each prompt token after the first
    min_tokens: int = 0  # stop tokens are banned, stop strings ignored, until this many are out
    repetition_penalty: float = 1.0  # vLLM's: a seen token's logit divided by it if positive, else multiplied
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to those tokens' logits
    skip_special_tokens: bool = True  # control tokens (<|im_start|>) give no text
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only between requests of equal salts
    structured_outputs: dict | None = None  # vLLM's: one of json, json_object, regex, choice, grammar (structured.py)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        integers = ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs")  # last 3 may be None
        require(
            [
                *(typed(n, getattr(self, n), float) for n in numbers),
                *(typed(n, getattr(self, n), int, n in integers[3:]) for n in integers),
                *(typed(n, getattr(self, n), bool) for n in ("ignore_eos", "skip_special_tokens")),
                typed("structured_outputs", self.structured_outputs, dict, True),
                (
                    self.cache_salt is None or isinstance(self.cache_salt, str) and self.cache_salt,
                    "cache_salt must be a non-empty string",
                ),
                (
                    isinstance(self.stop, list) and all(isinstance(x, str) for x in self.stop),
                    "stop must be a string or a list of strings",
                ),
                (
                    isinstance(self.stop_token_ids, list) and all(type(t) is int for t in self.stop_token_ids),
                    "stop_token_ids must be a list of token ids",
                ),
                (
                    isinstance(self.logit_bias, dict)
                    and all(
                        (type(t) is int or isinstance(t, str) and t.isascii() and t.isdecimal())
                        and type(b) in (int, float)
                        for t, b in self.logit_bias.items()
                    ),
                    "logit_bias must map token ids to numbers",
                ),
            ]
        )
        self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        require(
            [
                (0 <= self.temperature <= 2, f"temperature must be in [0, 2], got {self.temperature}"),
                (all(self.stop), "stop cannot contain an empty string"),
                (self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2**64)"),
                (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                (self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (or -1 for off)"),
                (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                (self.max_tokens >= 1, "max_tokens must be >= 1"),
                (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
                (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
                *((getattr(self, n) in (None, *range(21)), f"{n} must be in [0, 20]") for n in integers[4:]),
                (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
                (0 < self.repetition_penalty < float("inf"), "repetition_penalty must be > 0 and finite"),
                (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            ]
        )
        if 0 < self.temperature < 0.01:  # as vLLM: logits divided by less can overflow float32
            self.temperature = 0.01


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """token_ids holds prompt then generated tokens; the first num_computed_tokens of them have their
    K/V in the cache (blocks in block_table)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = field(init=False, default=0)  # len(token_ids) at creation
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)  # host blocks while swapped out
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrivals))
    stop_ids: frozenset[int] = frozenset()  # tokens that end it: its own stop_token_ids, and EOS unless ignored
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # seconds from arrival_time to its first step
    seed: int = 0  # its random numbers' key, with each output's position (sampler.uniforms)
    detokenizer: Any = None  # tokenizer.IncrementalDetokenizer
    draft: list[int] = field(default_factory=list)  # this step's draft tokens, after token_ids (speculation.py)
    ngrams: Any = None  # speculation.NgramIndex
    grammar: Any = None  # structured.Matcher, for a request with structured_outputs
    prompt_logprobs: list = field(default_factory=list)  # sampler.TokenLogprob of prompt tokens 1, 2, ... so far

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        # A decoding sequence has exactly one uncomputed token: the one it sampled last step.
        return self.num_tokens - self.num_computed_tokens > 1
