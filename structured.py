"""Structured output: a request's grammar (a JSON schema, any JSON, a regular expression, a choice of strings, an
EBNF or Lark grammar) as a mask over the vocabulary, row by row. llguidance (used by vLLM and llama.cpp) parses the
grammar and tracks where a sequence's output stands in it; the sampler asks a sequence's Matcher which tokens may
come next (on its draft rows too, as if the drafts before them were emitted), and the engine tells it each token
emitted. A mask depends on the sequence's own grammar and output alone: lanes stay apart."""

from __future__ import annotations

import concurrent.futures
import json
import os

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
        matcher.compute_bitmask()  # an empty language (a regex like a[^\s\S]) allows no first token: an error here
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind} matches no text")
        return Matcher(matcher)


class Matcher:
    """Where one sequence's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """The token emitted next; False if the grammar forbids it (every allowed token was banned otherwise)."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token emitted, or it can take no more tokens."""
        return self.matcher.is_stopped()


_threads: llguidance.LLExecutor | None = None  # llguidance's own, made at the first mask
_worker = concurrent.futures.ThreadPoolExecutor(1, "grammar-masks")  # waits on llguidance while the model runs


class Masks:
    """A step's grammar masks, computed on llguidance's threads with the GIL released and applied by the sampler. With
    `overlap` (a GPU's step, during which the CPU waits) they are computed while the model runs, started before the
    forward pass; without it (a CPU's, whose forward pass takes every core), when the sampler needs them. Each
    (matcher, row, draft) masks its sequence's row (its next token) and the draft's rows after it, row + j as if
    draft[:j] had been emitted; once a draft is one the grammar refuses, the rows after it are left as they are
    (unreachable: the token before cannot equal that draft), and the matcher ends where it began."""

    def __init__(self, grammars: list[tuple[Matcher, int, list[int]]], num_rows: int, vocab_size: int, overlap: bool):
        self.rows = [r + j for _, r, d in grammars for j in range(len(d) + 1)]
        self.args = (grammars, self.rows, num_rows, vocab_size)
        self.forbidden = _worker.submit(_forbidden, *self.args) if overlap else None

    def apply(self, logits: torch.Tensor) -> None:
        """-inf at every token a grammar forbids."""
        forbidden = (self.forbidden.result() if self.forbidden else _forbidden(*self.args)).to(logits.device)
        if len(self.rows) == len(logits):  # every row, in order: in place, without gathering them first
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            logits[self.rows] = logits[self.rows].masked_fill(forbidden, float("-inf"))


def masks(seqs: list, vocab_size: int, overlap: bool) -> Masks | None:
    """The masks of a step sampling seqs (sequence.Sequence), each a row and then a row per draft token; None when
    none has a grammar."""
    grammars, row = [], 0
    for seq in seqs:
        grammars += [(seq.grammar, row, seq.draft)] if seq.grammar else []
        row += 1 + len(seq.draft)
    return Masks(grammars, row, vocab_size, overlap) if grammars else None


def _forbidden(grammars: list[tuple[Matcher, int, list[int]]], rows: list[int], num_rows: int, vocab_size: int):
    """[len(rows), vocab_size] True where a row's grammar forbids the token; every row computed on its own."""
    global _threads
    _threads = _threads or llguidance.LLExecutor(os.cpu_count())  # its default takes 80% of the cores
    bits = torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # -1: all allowed
    plain, drafted = [(m.matcher, r) for m, r, d in grammars if not d], [(m.matcher, r, d) for m, r, d in grammars if d]
    # Into bits' memory directly (llguidance.torch wraps the same calls, but its import sets up torch.compile).
    size = (bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])
    if plain:
        _threads.unsafe_compute_mask_ptr(plain, *size)
    if drafted:
        _threads.unsafe_compute_mask_ptr_with_draft_token(drafted, *size)
    # Only the grammars' rows are unpacked. A mask's bit t % 32 of word t // 32 is token t: its bytes in
    # little-endian order, unpacked least significant bit first.
    allowed = np.unpackbits(bits[rows].numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(allowed == 0)
