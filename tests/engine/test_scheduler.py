"""Scheduler rules, without a model: budget, batch size, chunking, preemption, admission."""

from __future__ import annotations

import random

import pytest

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.sequence import Sequence, SequenceStatus


def _scheduler(num_blocks: int = 64, **cfg: object) -> Scheduler:
    config = EngineConfig(block_size=4, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, 4))


def _add(s: Scheduler, n_tokens: int, rid: str) -> Sequence:
    first = 1000 * (len(s.waiting) + len(s.running) + 1)  # distinct prompts: no prefix hits
    seq = Sequence(rid, list(range(first, first + n_tokens)), SamplingParams(max_tokens=50))
    s.add(seq)
    return seq


def _add_seq(s: Scheduler, tokens: list[int], rid: str, priority: int = 0) -> Sequence:
    seq = Sequence(rid, tokens, SamplingParams(max_tokens=50), priority=priority)
    s.add(seq)
    return seq


def _step(s: Scheduler, sample: int = 7) -> dict[str, int]:
    """One fake step: every sequence that completes its known tokens 'samples' a token."""
    out = s.schedule()
    done = [item.seq for item in out.scheduled if item.samples]
    s.on_step_computed(out)
    for seq in done:
        seq.token_ids.append(sample)
    return {item.seq.request_id: item.num_new_tokens for item in out.scheduled}


def test_token_budget_chunks_long_prompts_and_mixes_decodes() -> None:
    s = _scheduler(max_num_batched_tokens=16)
    _add(s, 10, "short")
    long_seq = _add(s, 40, "long")
    assert _step(s) == {"short": 10, "long": 6}
    step2 = _step(s)
    assert step2 == {"short": 1, "long": 15}  # the decode rides along with the next chunk
    _step(s)
    assert long_seq.num_computed_tokens == 36
    assert _step(s) == {"short": 1, "long": 4}
    assert long_seq.num_output_tokens == 1


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = _scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    _add(s, 10, "a")
    _add(s, 10, "b")
    assert _step(s) == {"a": 10}
    assert _step(s) == {"a": 1, "b": 10}


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = _scheduler(max_num_seqs=2)
    for i in range(5):
        _add(s, 3, f"r{i}")
    assert set(_step(s)) == {"r0", "r1"}
    assert len(s.running) == 2 and len(s.waiting) == 3


def test_kv_pressure_preempts_the_newest_and_recomputes_it_later() -> None:
    s = _scheduler(num_blocks=4)  # 16 tokens in all
    a = _add(s, 8, "a")
    b = _add(s, 8, "b")
    _step(s)  # both prefilled: 2 full blocks each -> cache full
    assert s.block_manager.num_free_blocks == 0
    scheduled = _step(s)  # a needs a 3rd block: b (newest) is preempted
    assert scheduled == {"a": 1}
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.stats.num_preemptions == 1
    assert s.waiting == [b]  # waiting again, ahead of anything that arrives later
    assert b.output_token_ids == [7]  # generated work is kept: recomputed, not lost
    assert a.status is SequenceStatus.RUNNING


def test_no_admission_in_a_step_that_preempted() -> None:
    s = _scheduler(num_blocks=4)
    _add(s, 8, "a")
    _add(s, 8, "b")
    _step(s)
    _add(s, 1, "tiny")
    scheduled = _step(s)
    assert "tiny" not in scheduled


def test_shared_prefix_is_admitted_from_cache() -> None:
    s = _scheduler(max_num_batched_tokens=64)
    a = Sequence("a", list(range(1, 11)), SamplingParams())
    s.add(a)
    _step(s)
    b = Sequence("b", list(range(1, 11)) + [77], SamplingParams())
    s.add(b)
    assert _step(s) == {"a": 1, "b": 3}  # 8 tokens (2 full blocks) came from the cache
    assert b.num_cached_tokens == 8
    assert s.stats.prefix_cache_hits == 8 and s.stats.prefix_cache_queries == 10 + 11


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    s = _scheduler(num_blocks=4, scheduling_policy="priority", max_num_seqs=2)
    _add_seq(s, list(range(100, 108)), "low", priority=5)
    _add_seq(s, list(range(200, 208)), "high", priority=0)
    _add_seq(s, list(range(300, 304)), "later-high", priority=0)
    assert _step(s) == {"high": 8, "later-high": 4}  # low arrived first but waits

    s = _scheduler(num_blocks=4, scheduling_policy="priority")
    low = _add_seq(s, list(range(100, 107)), "low", priority=5)
    _step(s)
    high = _add_seq(s, list(range(200, 208)), "high", priority=0)
    assert _step(s) == {"low": 1, "high": 8}  # cache now full
    assert _step(s) == {"high": 1}  # high needs a block: the older but lower-priority low goes
    assert low.status is SequenceStatus.WAITING and high.status is SequenceStatus.RUNNING


def test_length_policy_admits_short_prompts_first_and_ages_long_ones() -> None:
    s = _scheduler(max_num_batched_tokens=12, scheduling_policy="length", length_aging_s=3600)
    _add(s, 40, "long")
    _add(s, 5, "short1")
    _add(s, 6, "short2")
    assert _step(s) == {"short1": 5, "short2": 6, "long": 1}
    aged = _scheduler(max_num_batched_tokens=12, scheduling_policy="length", length_aging_s=0)
    _add(aged, 40, "long")
    _add(aged, 5, "short1")
    assert _step(aged) == {"long": 12}  # waited past the (zero) aging bound: goes first


def test_length_policy_keeps_a_batch_that_arrived_together_shortest_first() -> None:
    """An offline batch arrives at once: however long it has waited, shortest still goes first
    (a fixed aging cut-off would flip every request to arrival order at the same moment)."""
    s = _scheduler(max_num_batched_tokens=12, scheduling_policy="length", length_aging_s=1, max_model_len=64)
    seqs = [_add(s, 40, "long"), _add(s, 5, "short1"), _add(s, 6, "short2")]
    for seq in seqs:
        seq.timings.arrival -= 100.0  # everyone has waited 100x the aging bound
    assert _step(s) == {"short1": 5, "short2": 6, "long": 1}


def test_length_policy_never_lets_a_much_younger_request_pass() -> None:
    s = _scheduler(max_num_batched_tokens=12, scheduling_policy="length", length_aging_s=10, max_model_len=64)
    long = _add(s, 40, "long")
    long.timings.arrival -= 10.5  # arrived more than the aging bound before the short one
    _add(s, 5, "short")
    assert _step(s) == {"long": 12}
    recent = _scheduler(max_num_batched_tokens=12, scheduling_policy="length", length_aging_s=10, max_model_len=64)
    early = _add(recent, 40, "long")
    early.timings.arrival -= 0.5  # only just earlier: shortest first still
    _add(recent, 5, "short")
    assert _step(recent) == {"short": 5, "long": 7}


def test_watermark_holds_back_admissions_but_never_an_empty_engine() -> None:
    s = _scheduler(num_blocks=10, kv_watermark=0.3)  # keep 3 blocks free
    _add(s, 24, "big")  # 6 blocks: admitted, nothing is running
    assert _step(s) == {"big": 24}
    _add(s, 4, "small")  # 1 block: 4 free - 1 < 3 -> held back
    assert _step(s) == {"big": 1}
    lone = _scheduler(num_blocks=10, kv_watermark=0.3)
    _add(lone, 36, "fills-cache")  # 9 of 10 blocks, above the watermark, but alone
    assert _step(lone) == {"fills-cache": 36}


def test_a_protected_request_is_not_the_victim_while_others_can_be() -> None:
    s = _scheduler(num_blocks=4, max_preemptions=1)
    a = _add(s, 8, "a")
    b = _add(s, 8, "b")
    b.num_preemptions = 1  # reached the bound: protected, although newest
    _step(s)
    _step(s)
    assert a.status is SequenceStatus.WAITING and b.status is SequenceStatus.RUNNING


@pytest.mark.parametrize("policy", ["fcfs", "priority", "length"])
def test_every_request_finishes_under_heavy_kv_pressure(policy: str) -> None:
    """A cache of 10 blocks, 12 requests that each need up to 5: lots of preemption, no livelock."""
    rng = random.Random(0)
    s = _scheduler(num_blocks=10, max_num_batched_tokens=16, scheduling_policy=policy, max_preemptions=2)
    seqs = [
        _add_seq(s, [rng.randrange(1, 50) for _ in range(rng.randrange(3, 12))], f"r{i}", priority=i % 3)
        for i in range(12)
    ]
    for _ in range(2000):
        if not s.num_unfinished:
            break
        _step(s)
        for seq in list(s.running):
            if seq.num_output_tokens >= 8 and not seq.in_prefill:
                s.finish(seq, "length")
        assert s.block_manager.num_free_blocks + sum(len(q.block_table) for q in s.running) >= 10
    assert s.num_unfinished == 0
    assert s.stats.num_preemptions > 0
    assert all(q.output_token_ids == [7] * 8 for q in seqs)  # nothing lost or duplicated
    assert s.block_manager.num_free_blocks == 10


def test_requests_sharing_an_uncached_prefix_compute_it_once() -> None:
    s = _scheduler(max_num_batched_tokens=8)  # the 16-token prefix takes a first request 2 steps
    shared = list(range(500, 516))
    first = _add_seq(s, shared + [1, 2], "first")
    second = _add_seq(s, shared + [3, 4], "second")
    assert _step(s) == {"first": 8}  # second defers: its first block is being computed
    assert _step(s) == {"first": 8}
    scheduled = _step(s)
    assert scheduled == {"first": 2, "second": 2}  # 16 prefix tokens served from the cache
    assert second.num_cached_tokens == 16 and first.num_cached_tokens == 0
