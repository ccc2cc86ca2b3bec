"""Structured output: a request's grammar (a JSON schema, any JSON, a regular expression, a choice of strings, an
EBNF or Lark grammar) as a mask over the vocabulary, row by row. llguidance (used by vLLM and llama.cpp) parses the
grammar and tracks where a sequence's output stands in it; the sampler asks a sequence's Matcher which tokens may
come next (on its draft rows too, as if the drafts before them were emitted), and the engine tells it each token
emitted. A mask depends on the sequence's own grammar and output alone: lanes stay apart."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import torch

# vLLM's StructuredOutputsParams: exactly one of these keys, as SamplingParams.structured_outputs.
KINDS = {
    "json": "json_schema",
    "json_object": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


class Vocabulary:
    """The tokenizer as llguidance reads it: each id's bytes, its special ids, and text to ids."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(vocab_size)]
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special.values())
        self.encode = tokenizer.encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self.encode(text if isinstance(text, str) else text.decode("utf-8", "replace"))


class Grammars:
    """One engine's grammars, over its tokenizer: a request's structured_outputs to a Matcher."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size, self.source, self.tokenizer = vocab_size, tokenizer, None  # llguidance's, at the first use

    def matcher(self, spec: dict) -> Matcher:
        """A fresh matcher for a request's structured_outputs, or ValueError saying what is wrong with it."""
        if self.tokenizer is None:
            wrapper = llguidance.TokenizerWrapper(Vocabulary(self.source, self.vocab_size))
            stops = sorted(self.source.stop_token_ids)
            self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=stops)
        if not isinstance(spec, dict) or len(spec) != 1 or (kind := next(iter(spec))) not in KINDS:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}")
        value = {"type": "object"} if kind == "json_object" else spec[kind]
        if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if kind in ("json", "json_object", "choice") and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        try:
            grammar = llguidance.grammar_from(KINDS[kind], value)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"structured_outputs.{kind} does not compile: {str(e).strip()[:500]}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} does not compile: {matcher.get_error().strip()[:500]}")
        return Matcher(matcher, self.vocab_size)


class Matcher:
    """Where one sequence's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """Which tokens the grammar allows next, as booleans over the vocabulary."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool))

    def mask(self, logits: torch.Tensor, row: int, draft: list[int]) -> None:
        """-inf at every token the grammar forbids, on this sequence's rows of logits from `row` on: its next
        token's, then its drafts'. Row row + j is masked as if draft[:j] had been emitted; once a draft is one the
        grammar refuses, the rows after it are left as they are (unreachable: the token before cannot equal that
        draft). Then the matcher goes back to where it was."""
        masks = []
        for j in range(len(draft) + 1):
            masks.append(self.allowed())
            if j == len(draft) or not masks[-1][draft[j]] or not self.matcher.consume_token(draft[j]):
                break
        self.matcher.rollback(len(masks) - 1)
        reached = slice(row, row + len(masks))
        logits[reached] = logits[reached].masked_fill(~torch.stack(masks).to(logits.device), float("-inf"))

    def accept(self, token: int) -> bool:
        """The token emitted next; False if the grammar forbids it (every allowed token was banned otherwise)."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token emitted, or it can take no more tokens."""
        return self.matcher.is_stopped()
