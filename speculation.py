"""Speculative decoding with n-gram (prompt lookup) drafts, exact: a request's tokens and logprobs are bit for bit
those of plain decoding. The scheduler gives a decoding sequence up to num_speculative_tokens draft tokens, found
by looking its last tokens up earlier in its own prompt and output; the runner computes them as more query tokens
of the sequence (each a generated token at its position, so its logits are those a plain decode there would give:
ARCHITECTURE.md, "Lanes never mix"); the sampler samples every position at once, each with the sequence's own
random numbers, and the engine keeps a draft while the token sampled before it equals it. No row is free (the CPU
kernel does not pad), so a lane drafts as much as its drafts get accepted."""

from __future__ import annotations

from kv_cache import BlockManager
from sequence import Sequence

# Query tokens a step may hold with drafts: decoding lanes share what they leave of it. A row is not free
# (benchmarks/README.md, "Speculative decoding", has what it costs): a lane's drafts are paid for by those it gets
# accepted.
DRAFT_ROWS = 8


class NgramIndex:
    """Where each n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of a sequence's tokens last ended,
    extended as tokens append: a step indexes only the tokens new since the last, never rescans."""

    def __init__(self, lookup_min: int, lookup_max: int, limit: int):
        self.sizes = range(lookup_max, lookup_min - 1, -1)  # longest first
        self.ends: dict[tuple[int, ...], int] = {}  # an n-gram -> the index just past its latest occurrence
        self.indexed = 0  # n-grams ending at indices up to this one are in `ends`
        # No row is free (benchmarks/README.md, "Speculative decoding"), so a lane's drafts follow what it gets
        # accepted: one more token than its last verify accepted, twice a draft accepted whole; after a draft
        # rejected at its first token, none for 1, 2, 4, ... 16 steps, until one is accepted again.
        self.limit, self.wait, self.backoff = limit, 0, 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.limit = 2 * drafted if accepted == drafted else accepted + 1
        self.backoff = min(16, 2 * self.backoff or 1) if not accepted else 0
        self.wait = self.backoff

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of tokens found."""
        last = len(tokens) - 1  # the suffix itself ends past `last`: indexed next time, never matched to itself
        for end in range(self.indexed + 1, last + 1):
            for n in self.sizes:
                if n <= end:
                    self.ends[tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, last)
        if self.wait:
            self.wait -= 1
            return []
        for n in self.sizes:
            if n <= len(tokens) and (end := self.ends.get(tuple(tokens[-n:]))) is not None:
                # What followed it, continued past the end as the repeat would go on (period len(tokens) - end).
                draft = tokens[end : end + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(tokens) - end)])
                return draft
        return []


def draft_share(k: int, decoding: int) -> int:
    """Draft tokens per decoding sequence this step (k: num_speculative_tokens): DRAFT_ROWS shared fairly among the
    decoding sequences, none once their decodes fill it."""
    decoding = decoding or 1
    return max(0, min(k, (DRAFT_ROWS - decoding) // decoding))


def propose(seq: Sequence, k: int, blocks: BlockManager, reserve: int, lookup: tuple[int, int]) -> list[int]:
    """Set decoding sequence seq's draft for this step: at most k tokens (its share within the step's token budget),
    none past what max_tokens leaves after the token this step samples anyway, and only into blocks that are free
    with `reserve` more besides (a draft never preempts). lookup: prompt_lookup_min and _max."""
    k = min(k, seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens) - 1)
    if k <= 0:
        return []
    if seq.ngrams is None:
        seq.ngrams = NgramIndex(*lookup, k)
    draft = seq.ngrams.propose(seq.token_ids, min(k, seq.ngrams.limit))
    if (
        blocks.blocks_needed(seq.block_table, seq.num_computed_tokens + 1 + len(draft)) + reserve
        <= blocks.num_free_blocks
    ):
        seq.draft = draft
    return seq.draft


def settle(seq: Sequence, accepted: int, blocks: BlockManager, block_size: int) -> tuple[int, int]:
    """After the engine emitted seq's tokens (and counted the accepted drafts' K/V as computed): its index learns
    how many were accepted, and the blocks taken for the rejected ones go back to the pool. Returns (drafted,
    accepted)."""
    drafted, seq.draft = len(seq.draft), []
    seq.ngrams.verified(drafted, accepted)
    keep = -(-seq.num_computed_tokens // block_size)  # none once finished
    blocks.free(seq.block_table[keep:])
    del seq.block_table[keep:]
    return drafted, accepted
