"""Who runs this step: sequences, their states, and iteration-level admission under a token budget."""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kv_cache import BlockManager

if TYPE_CHECKING:
    from engine import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's lane. token_ids holds prompt then generated tokens; the first
    num_computed_tokens of them have their K/V in the cache (blocks in block_table)."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrivals))
    generator: Any = None    # the lane's own torch.Generator, so its samples ignore its neighbours
    detokenizer: Any = None  # tokenizer.IncrementalDetokenizer

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        # A decoding lane has exactly one uncached token: the one it sampled last step.
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    # "continuous": the batch is rebuilt every step. "static": a new batch is admitted only once
    # every lane of the previous one has finished (request-level batching, for comparison).
    scheduling: str = "continuous"


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's lanes and how many new tokens each computes. Running lanes go first
        (decodes, then unfinished prefills), then waiting requests in arrival order, while
        the token budget, max_num_seqs and free KV blocks allow."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        for seq in sorted(self.running, key=lambda s: (s.is_prefilling, s.arrival)):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted below to make room for an earlier lane
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, scheduled):
                continue
            scheduled.append((seq, n))
            budget -= n
        admit = not self.running or self.config.scheduling == "continuous"
        while admit and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.blocks.can_allocate(seq.block_table, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.block_table, seq.num_computed_tokens + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _reserve(self, seq: Sequence, n: int, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Grow seq's blocks for n more tokens, preempting the most recently arrived running lanes
        not already scheduled this step while none are free. False if seq itself was preempted."""
        need = seq.num_computed_tokens + n
        taken = {id(s) for s, _ in scheduled}
        while not self.blocks.can_allocate(seq.block_table, need):
            victim = max((s for s in self.running if id(s) not in taken), key=lambda s: s.arrival)
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq.block_table, need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the lane's KV and requeue it ahead of new arrivals. Its
        generated tokens stay in token_ids, so its next prefill recomputes them as prompt."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        # Earlier-arrived lanes are preempted later, so they end up in front: arrival order holds.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a lane (finished or aborted): its slot and KV blocks are free at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
