"""Continuous batching: every step closes each request's gap between tokens known and tokens
computed, under a per-step token budget and the KV-cache blocks that are free.

Running requests go first: decodes (with their draft tokens where blocks are free and the budget
reaches), then unfinished prefills (chunked under the budget) in policy order. When one cannot get
a block, the policy's worst running request (lowest priority, then newest) is preempted: its
blocks are freed and it waits to be recomputed (its finished blocks usually come straight back
from the prefix cache). Waiting requests are admitted in policy order, only in steps that did
not preempt, and only while a free-block watermark stays untouched, so admissions do not
immediately cause preemptions.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.interface import FinishReason, SchedulerMetrics, SchedulerStats
from tokenmill.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """A sequence's share of a step, as scheduled: read after the step is computed (which moves the
    sequence's counts on), it still says what the step held."""

    seq: Sequence
    num_new_tokens: int  # its draft tokens included
    prefill: bool = field(init=False)  # it computes prompt (or recomputed) tokens, not a decode
    samples: bool = field(init=False)  # this step computes its last known token, so a next one is due
    num_drafts: int = field(init=False)  # draft tokens scored after the last known one, each sampled too

    def __post_init__(self) -> None:
        beyond = self.seq.num_computed_tokens + self.num_new_tokens - self.seq.num_tokens
        self.prefill = self.seq.in_prefill
        self.samples = beyond >= 0
        self.num_drafts = max(0, beyond)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def decode_tokens(self) -> int | None:
        """The tokens of a step that only decodes (drafts included); None for one that prefills."""
        if any(item.prefill for item in self.scheduled):
            return None
        return sum(item.num_new_tokens for item in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        # "length" ages requests linearly: a second of waiting counts as this many tokens less
        # remaining prefill, so a prompt of max_model_len tokens catches up with a fresh empty
        # one after length_aging_s.
        longest = max_model_len or config.max_model_len or block_manager.num_blocks * config.block_size
        self._aging_rate = longest / config.length_aging_s if config.length_aging_s > 0 else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        # The running batch's cap: config.max_num_seqs, or lower (LLMEngine.set_max_num_seqs).
        self.max_num_seqs = config.max_num_seqs
        self._arrivals = itertools.count()
        self._watermark = int(config.kv_watermark * block_manager.num_blocks)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def metrics(self) -> SchedulerMetrics:
        """A snapshot with its own copy of the counters, safe to read on another thread."""
        stats = dataclasses.replace(self.stats)
        return SchedulerMetrics(len(self.running), len(self.waiting), self.block_manager.usage, stats)

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = next(self._arrivals)
        self.waiting.append(seq)

    # ---- policy ---------------------------------------------------------------------------
    def _waiting_key(self, seq: Sequence, now: float) -> tuple:
        policy = self.config.scheduling_policy
        if policy == "priority":
            return (seq.priority, seq.arrival_order)
        if policy == "length" and self._aging_rate is not None:
            # Shortest remaining prefill first, aged by time waited. Requests that arrive together
            # age alike and stay shortest-first (a fixed "waited too long" cut-off would turn a
            # whole offline batch into fcfs at once); a request is never passed by one that
            # arrived more than length_aging_s after it, so long prompts cannot starve.
            remaining = seq.num_tokens - seq.num_computed_tokens
            return (remaining - self._aging_rate * (now - seq.timings.arrival), seq.arrival_order)
        return (seq.arrival_order,)  # fcfs; also "length" with a zero aging bound

    def _victim_key(self, seq: Sequence) -> tuple:
        # Requests preempted too often are protected: only taken once nothing else is left,
        # so the oldest of them always makes progress and nothing is preempted forever.
        protected = seq.num_preemptions >= self.config.max_preemptions
        return (not protected, seq.priority, seq.arrival_order)

    # ---- the step -------------------------------------------------------------------------
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
        now = time.monotonic()
        # Decodes first (one token each, latency-critical), then prefill chunks by policy.
        order = sorted(self.running, key=lambda s: (s.in_prefill, self._waiting_key(s, now)))
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            gap = seq.num_tokens - seq.num_computed_tokens
            n = min(gap + len(seq.draft_token_ids), budget)
            if n > gap and not self.block_manager.allocate(seq, n):
                n = min(gap, budget)  # drafts take only free blocks: they never preempt anyone
            del seq.draft_token_ids[max(0, n - gap):]
            if not seq.draft_token_ids and not self._allocate_or_preempt(seq, n, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return budget

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        scheduled = {id(item.seq) for item in out.scheduled}
        while not self.block_manager.allocate(seq, n):
            candidates = [s for s in self.running if id(s) not in scheduled]
            victim = max(candidates, key=self._victim_key)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        now = time.monotonic()
        pending = self._blocks_being_computed()
        for seq in sorted(self.waiting, key=lambda s: self._waiting_key(s, now)):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            hits = bm.find_cached_prefix(seq)
            if self._waits_for_shared_prefix(seq, len(hits), pending):
                continue
            remaining = seq.num_tokens - len(hits) * bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            needed = bm.num_new_blocks_needed(seq, n, len(hits))
            if self.running and needed + self._watermark > bm.num_free_blocks:
                break
            if not bm.allocate(seq, n, hits):
                break
            self._start(seq, hits)
            self._note_pending(seq, pending)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _start(self, seq: Sequence, hits: list[int]) -> None:
        self.waiting.remove(seq)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = len(hits) * self.block_manager.block_size
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # ---- prefix-aware admission -------------------------------------------------------------
    def _blocks_being_computed(self) -> set[int]:
        """Hashes of full blocks that running requests will compute but have not yet cached."""
        pending: set[int] = set()
        for seq in self.running:
            self._note_pending(seq, pending)
        return pending

    def _note_pending(self, seq: Sequence, pending: set[int]) -> None:
        if not self.config.enable_prefix_caching:
            return
        bm = self.block_manager
        first = seq.num_computed_tokens // bm.block_size
        for index in range(first, seq.num_prompt_tokens // bm.block_size):
            pending.add(bm.block_hash(seq, index))

    def _waits_for_shared_prefix(self, seq: Sequence, num_hits: int, pending: set[int]) -> bool:
        """Defer a request whose next block another request is computing right now: it will
        be a cache hit in a step or two instead of being computed twice."""
        if not pending or (num_hits + 1) * self.block_manager.block_size >= seq.num_tokens:
            return False
        return self.block_manager.block_hash(seq, num_hits) in pending

    # ---- state changes ----------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.draft_token_ids.clear()
        self.running.remove(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.stats.num_preemptions += 1
        self.waiting.append(seq)

    def on_step_computed(self, out: SchedulerOutput, accepted: list[int] | None = None) -> None:
        """Advance computed counts after the model ran, and publish newly full blocks. `accepted`:
        how many of each item's drafts were kept; the KV of the others is rolled back (their slots
        are written over later, never counted as computed, never cached) and blocks that only they
        used are freed."""
        stats = self.stats
        stats.num_steps += 1
        for i, item in enumerate(out.scheduled):
            seq, drafts = item.seq, item.num_drafts
            kept = item.num_new_tokens - drafts + (accepted[i] if accepted else 0)
            if seq.in_prefill:
                stats.prefill_tokens += kept
            else:
                stats.decode_tokens += kept
            if drafts:
                stats.num_drafts += 1
                stats.num_draft_tokens += drafts
                stats.num_accepted_tokens += kept - (item.num_new_tokens - drafts)
            seq.num_computed_tokens += kept
            seq.draft_token_ids.clear()
            if kept < item.num_new_tokens:
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            self.block_manager.register_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.timings.finished = time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.draft_token_ids.clear()
