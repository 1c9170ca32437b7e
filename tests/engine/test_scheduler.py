"""Scheduler rules, without a model: budget, batch size, chunking, preemption, admission."""

from __future__ import annotations

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
    assert s.waiting[0] is b  # back at the front
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
