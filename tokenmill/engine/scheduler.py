"""Continuous batching: every step closes each request's gap between tokens known and tokens
computed, under a per-step token budget and the KV-cache blocks that are free.

Running requests go first (oldest first); when one cannot get a block, the newest running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (its finished blocks usually come straight back from the prefix cache).
Waiting requests are admitted only in steps that did not have to preempt.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.model_runner import ScheduledSequence
from tokenmill.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Cumulative counters (tokens, not requests, for the prefix cache)."""

    prefix_cache_queries: int = 0  # prompt tokens looked up at first admission
    prefix_cache_hits: int = 0  # of which served from the cache
    num_preemptions: int = 0
    num_steps: int = 0
    prefill_tokens: int = 0  # tokens computed that were already known (prompt or recompute)
    decode_tokens: int = 0  # tokens computed that came from the previous sample


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        now = time.monotonic()
        for item in out.scheduled:
            if item.seq.timings.scheduled is None:
                item.seq.timings.scheduled = now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, n):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return budget
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
            i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(hits) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if not bm.allocate(seq, n, hits):
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = len(hits) * bm.block_size
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_computed(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the model ran, and publish newly full blocks."""
        self.stats.num_steps += 1
        for item in out.scheduled:
            seq = item.seq
            if seq.in_prefill:
                self.stats.prefill_tokens += item.num_new_tokens
            else:
                self.stats.decode_tokens += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
