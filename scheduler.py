"""Who runs this step: sequences, their states, and iteration-level admission under a token budget."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from config import EngineConfig
from kv_cache import BlockManager
from sequence import Sequence, Status
from speculation import draft_share, propose


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]]  # sequences and how many new tokens each computes
    swap_out: list[tuple[int, int]]  # (device block, host block) copies to make first
    swap_in: list[tuple[int, int]]  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)  # their status says how: WAITING or SWAPPED
    swapped_in: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Continuous (iteration-level) batching: the batch is rebuilt every step, so a finished sequence's
    place in the batch and its blocks go to a waiting one at once. Static (request-level) batching, for
    comparison, admits a new batch only once every sequence of the last one has finished. When a running
    sequence needs a block and none is free, the most recently arrived running sequence is preempted:
    "recompute" drops its KV, "swap" copies it to host memory (recompute when the swap space is full)."""

    def __init__(self, config: EngineConfig, blocks: BlockManager, swap_space: BlockManager):
        self.config = config
        self.blocks = blocks
        self.swap_space = swap_space
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        # Preemptions, prompt tokens looked up in the prefix cache, and those served from it.
        self.num_preemptions = self.prefix_queries = self.prefix_hits = 0
        self.budget = 0  # tokens this step may still compute, reset by schedule()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences. Running sequences go first (decodes, then unfinished prefills), then
        swapped-out sequences come back, and only then are waiting requests admitted in arrival
        order, while the token budget, max_num_seqs and free KV blocks allow."""
        out = SchedulerOutput([], [], [])
        self.budget = self.config.max_num_batched_tokens
        k = self.config.num_speculative_tokens  # draft tokens per decoding sequence, counted only when speculating:
        self.drafts = draft_share(k, sum(not s.is_prefilling for s in self.running)) if k else 0
        preemptions = self.num_preemptions
        if self.config.scheduling == "static" and not self.running and not self.swapped:
            self._admit_static_batch()
        for seq in sorted(self.running, key=lambda s: (s.is_prefilling, s.arrival)):
            if self.budget == 0:
                break
            if seq.status is Status.RUNNING:  # not preempted meanwhile to make room for an earlier sequence
                self._reserve(seq, out)
        while self.swapped and self.budget and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = self._cut(seq, seq.num_computed_tokens)
            if n == 0 or not self.blocks.can_allocate([], seq.num_computed_tokens + n):
                break
            self.swapped.popleft()
            self._schedule(seq, n, out)
            # zip stops at the host blocks: a block allocated for this step's new token has nothing to copy.
            out.swap_in += zip(seq.swap_table, seq.block_table)
            out.swapped_in.append(seq)
            self.swap_space.free(seq.swap_table)
        # No admissions in a step that had to preempt: the pool is full, and a sequence admitted now
        # would only be preempted again next step.
        while (
            self.config.scheduling == "continuous"
            and not self.swapped
            and self.waiting
            and preemptions == self.num_preemptions
            and self.budget
            and len(self.running) < self.config.max_num_seqs
        ):
            if not self._admit(self.waiting[0], out):
                break
            self.waiting.popleft()
        return out

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Start a waiting sequence: share what the prefix cache holds, then compute the first piece of
        the rest. False (and nothing held) if it does not fit."""
        # Prompt logprobs skip the cache (as vLLM's): a cached prefix has no logits.
        prompt = seq.token_ids[: seq.num_prompt_tokens] if seq.params.prompt_logprobs is None else []
        cached = self.blocks.match_prefix(seq.block_table, prompt, seq.params.cache_salt)
        n = self._cut(seq, cached)
        if n == 0 or not self.blocks.can_allocate(seq.block_table, cached + n):
            self.blocks.free(seq.block_table)
            return False
        if self.blocks.enable_prefix_caching:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += cached
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        self._schedule(seq, n, out)
        return True

    def _admit_static_batch(self) -> None:
        """Static mode: the next batch is the first max_num_seqs waiting requests whose prompts
        fit in KV; their prefills then run in chunks like any running sequence's."""
        free = self.blocks.num_free_blocks
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = self.blocks.blocks_needed([], self.waiting[0].num_tokens)
            if need > free:
                break
            free -= need
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _cut(self, seq: Sequence, computed: int) -> int:
        """How many of seq's tokens from position `computed` on run this step: all that are left if the
        budget allows, else (chunked prefill) as many as it allows. Without chunked prefill a prompt
        waits for a step with room for all of it; only a sequence recomputed after preemption can be
        longer than the budget, and it is chunked. Cuts can fall anywhere: no token's result depends
        on where its prompt was cut (ARCHITECTURE.md, "Lanes never mix")."""
        n, c = seq.num_tokens - computed, self.config
        return (
            n
            if n <= self.budget
            else 0
            if not c.enable_chunked_prefill and n <= c.max_num_batched_tokens
            else self.budget
        )

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Run n more of seq's tokens this step, in blocks the caller checked are free."""
        self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n)
        if seq.status is not Status.RUNNING:
            seq.status = Status.RUNNING
            self.running.append(seq)
        out.scheduled.append((seq, n))
        self.budget -= n

    def _reserve(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Schedule running sequence seq, preempting the most recently arrived running sequences not yet
        scheduled this step while no block is free for it (possibly seq itself)."""
        n = self._cut(seq, seq.num_computed_tokens)
        if n == 0:
            return
        while not self.blocks.can_allocate(seq.block_table, seq.num_computed_tokens + n):
            taken = {id(s) for s, _ in out.scheduled}  # only when short of blocks: O(sequences) a step otherwise
            victim = max((s for s in self.running if id(s) not in taken), key=lambda s: s.arrival)
            self.preempt(victim, out)
            if victim is seq:
                return
        if n == 1 and self.drafts:  # a block for each running sequence stays free: no later decode preempts for drafts
            lookup = (self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            n += len(propose(seq, min(self.drafts, self.budget - 1), self.blocks, len(self.running), lookup))
        self._schedule(seq, n, out)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.swap_space.can_allocate([], seq.num_computed_tokens):
            self.swap_space.allocate(seq.swap_table, seq.num_computed_tokens)
            out.swap_out += zip(seq.block_table, seq.swap_table)
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
        else:
            # Recompute: drop the KV and requeue ahead of new arrivals. The generated tokens stay in
            # token_ids, so the next prefill recomputes them too, still as generated tokens (the prompt's
            # end, num_prompt_tokens, does not move): the same bits as when they were first computed.
            seq.num_computed_tokens = 0
            seq.status = Status.WAITING
            # Earlier-arrived sequences are preempted later, so they end up in front: arrival order holds.
            self.waiting.appendleft(seq)
        self.blocks.free(seq.block_table)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence (finished or aborted): its place in the batch and its KV blocks are free at once."""
        {Status.RUNNING: self.running, Status.WAITING: self.waiting, Status.SWAPPED: self.swapped}.get(
            seq.status, []
        ).remove(seq)
        self.blocks.free(seq.block_table)
        self.swap_space.free(seq.swap_table)
        seq.status = Status.FINISHED
