"""The engine's steps as events, for watchers such as the live page at /: per step, each scheduled
sequence with what it did (a prefill piece, a decode, a prefix-cache hit, back from swap, finished),
the sequences preempted, the KV pool and the queues. No prompt or output text: a watcher sees shapes,
not content. Events go to a ring of the last `capacity`; each watcher reads from the step it connected at
(start), at its own pace, and is told how many of its steps fell out of the ring unread; steps that ran
while nobody watched are no watcher's. The engine thread only appends and notifies, so no watcher can slow
a step. Each event carries `t`, the server's monotonic clock when the step ended, so that a watcher that
reads a backlog at once still times the steps as they ran."""

from __future__ import annotations

import json
import threading
import time
from collections import deque

from scheduler import SchedulerOutput
from sequence import Sequence, Status

MAX_CACHED_IDS = 4096  # cached-but-free block ids sent per step; the count is always exact


class StepEvents:
    def __init__(self, capacity: int = 512):
        self.ring: deque[tuple[int, str]] = deque(maxlen=capacity)  # (step number, JSON)
        self.step = 0  # steps seen, watched or not
        self.watchers = 0  # while 0, steps are counted but no event is built
        self.cond = threading.Condition()

    def publish(self, engine, out: SchedulerOutput, outputs: list, seconds: float) -> None:
        """Engine.on_step: called on the engine thread after every step."""
        self.step += 1
        if not self.watchers:
            return
        text = json.dumps(step_event(self.step, engine, out, outputs, seconds), separators=(",", ":"))
        with self.cond:
            self.ring.append((self.step, text))
            self.cond.notify_all()

    def start(self) -> int:
        """A new watcher, counted until stop(): the step to read after. Every later step is built into an event."""
        with self.cond:
            self.watchers += 1
            return self.step

    def stop(self) -> None:
        with self.cond:
            self.watchers -= 1
            if not self.watchers:  # the next watcher starts after them anyway
                self.ring.clear()

    def read(self, after: int, timeout: float) -> tuple[list[str], int, int]:
        """The events after step `after` (start()'s, then the last read) still in the ring, waiting up to timeout
        for one: (events, the last step number read, how many after `after` fell out of the ring unread)."""
        with self.cond:
            self.cond.wait_for(lambda: self.ring and self.ring[-1][0] > after, timeout)
            new = [(n, text) for n, text in self.ring if n > after]
        if not new:
            return [], after, 0
        return [text for _, text in new], new[-1][0], new[0][0] - after - 1


def step_event(number: int, engine, out: SchedulerOutput, outputs: list, seconds: float) -> dict:
    s, bm = engine.scheduler, engine.block_manager
    finished = {o.request_id: o.finish_reason for o in outputs if o.finished}
    scheduled = {id(seq): n for seq, n in out.scheduled}
    swapped_in = {id(seq) for seq in out.swapped_in}

    def lane(seq: Sequence, n: int) -> dict:
        # Its draft rows and how many were accepted: Engine._emit's record.
        drafts, accepted = engine.verified.get(seq.request_id, (0, 0)) if n else (0, 0)
        before = seq.num_computed_tokens - (n - drafts + accepted)  # the tokens it had computed when the step began
        kind = "idle" if n == 0 else "prefill" if n - drafts > 1 or before < seq.num_prompt_tokens else "decode"
        d = {
            "id": seq.request_id,
            "kind": kind,
            "tokens": n,
            "kv": seq.num_computed_tokens,
            "blocks": list(seq.block_table),
        }
        if n and before == seq.num_cached_tokens > 0:
            d["hit"] = seq.num_cached_tokens
        if drafts:  # its draft rows this step, and how many were accepted
            d["drafts"], d["accepted"] = drafts, accepted
        if id(seq) in swapped_in:
            d["swapped_in"] = True
        if seq.request_id in finished:
            d["finished"] = finished[seq.request_id]
        return d

    lanes = [lane(seq, n) for seq, n in out.scheduled] + [lane(seq, 0) for seq in s.running if id(seq) not in scheduled]
    cached = [b for b in bm.free_blocks if bm.block_hash[b] is not None]
    return {
        "step": number,
        "t": round(time.monotonic(), 3),
        "ms": round(seconds * 1000, 2),
        "budget": engine.config.max_num_batched_tokens,
        "batch_tokens": sum(scheduled.values()),
        "lanes": lanes,
        "preempted": [
            {"id": seq.request_id, "mode": "swap" if seq.status is Status.SWAPPED else "recompute"}
            for seq in out.preempted
        ],
        "running": len(s.running),
        "waiting": len(s.waiting),
        "swapped": len(s.swapped),
        "preemptions": s.num_preemptions,
        "generated": engine.num_generation_tokens,
        "kv": {
            "blocks": bm.num_blocks,
            "free": bm.num_free_blocks,
            "cached": len(cached),
            "cached_ids": cached[:MAX_CACHED_IDS],
            "swap_used": s.swap_space.num_blocks - s.swap_space.num_free_blocks,
        },
    }
