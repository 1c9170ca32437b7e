"""The gate speculates where drafts were measured to raise output tokens per second, per batch band."""

from __future__ import annotations

from tokenmill.engine.speculative.gate import EXPLORE_EVERY, WARMUP_STEPS, SpeculationGate


def _run(gate: SpeculationGate, batch: int, steps: int, with_drafts: float, without: float) -> list[bool]:
    """`steps` decisions at `batch` sequences, each step taking one second and producing that many tokens."""
    decisions = []
    for _ in range(steps):
        speculate = gate.speculate(batch)
        gate.observe(batch, speculate, int(with_drafts if speculate else without), 1.0)
        decisions.append(speculate)
    return decisions


def test_it_keeps_drafts_where_they_pay_and_drops_them_where_they_lose() -> None:
    gate = SpeculationGate()
    small = _run(gate, 1, 400, with_drafts=30, without=10)
    large = _run(gate, 48, 400, with_drafts=90, without=100)
    assert sum(small[:2 * WARMUP_STEPS]) == WARMUP_STEPS  # each arm tried first
    after = len(small) - 2 * WARMUP_STEPS
    assert sum(small[2 * WARMUP_STEPS:]) == after - after // EXPLORE_EVERY
    # Where drafts lose, they run only while warming up and when exploring: a 10% slower arm costs
    # the whole run a small fraction of that.
    speculated = sum(large)
    assert speculated <= WARMUP_STEPS + len(large) // EXPLORE_EVERY + 1
    assert (speculated * 90 + (len(large) - speculated) * 100) / (len(large) * 100) > 0.99
    assert gate.rates() == {1: (30.0, 10.0), 32: (90.0, 100.0)}


def test_it_follows_a_change_in_the_workload() -> None:
    gate = SpeculationGate()
    _run(gate, 8, 200, with_drafts=30, without=10)
    later = _run(gate, 8, 400, with_drafts=5, without=10)  # acceptance collapsed
    assert sum(later[-2 * EXPLORE_EVERY:]) <= 2  # drafts only in the steps that explore


def test_a_band_not_yet_measured_follows_what_smaller_and_larger_ones_showed() -> None:
    gate = SpeculationGate()
    _run(gate, 4, 100, with_drafts=8, without=10)  # drafts lose at batch 4 ...
    assert sum(_run(gate, 64, 96, with_drafts=8, without=10)) == 96 // EXPLORE_EVERY  # ... so at 64 too, from the start
    other = SpeculationGate()
    _run(other, 32, 100, with_drafts=12, without=10)  # drafts pay at batch 32 ...
    assert sum(_run(other, 2, 96, with_drafts=12, without=10)) == 96 - 96 // EXPLORE_EVERY  # ... and at 2
