"""The draft budget keeps as many drafts in a step as raise its expected output tokens per second,
from the acceptance and the step costs it measured: the whole draft where extra tokens cost little,
as many as fit under the cost's knee where they cost more beyond it, none where they never pay."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tokenmill.engine.speculative.budget import (
    EXPLORE_EVERY,
    AcceptanceRates,
    DraftBudget,
    StepCost,
    bucket,
)


def test_buckets_are_exact_when_small_and_coarser_above() -> None:
    assert [bucket(t) for t in (1, 17, 32, 33, 40, 41, 64, 65, 80, 81, 129)] == [1, 17, 32, 40, 40, 48, 64, 80, 80,
                                                                                 96, 160]


def test_acceptance_is_per_position_given_the_earlier_ones() -> None:
    rates = AcceptanceRates()
    for _ in range(200):
        rates.observe(num_drafts=3, num_accepted=1)  # the first always kept, the second never
    first, second, third = rates.chances(3)
    assert first == pytest.approx(1.0, abs=1e-6) and second == pytest.approx(0.0, abs=1e-6)
    assert third <= second  # never reached: a chance is at most the one before it


def test_a_cost_is_interpolated_between_measured_steps_and_known_one_bucket_beyond() -> None:
    cost = StepCost()
    assert cost.estimate(4) is None
    for tokens, seconds in ((4, 1.0), (8, 1.0), (12, 2.0)):
        cost.observe(tokens, seconds)
    assert cost.estimate(6) == pytest.approx(1.0) and cost.estimate(10) == pytest.approx(1.5)
    assert cost.estimate(13) == pytest.approx(2.25)  # the last slope carried one bucket on
    assert cost.estimate(14) is None and cost.estimate(2) == 1.0


def _run(budget: DraftBudget, steps: int, batch: int, draft_len: int, accept: float,
         seconds: Callable[[int], float]) -> list[int]:
    """`steps` planned steps of `batch` sequences, each proposing `draft_len` tokens, each of which
    is accepted with chance `accept` when the ones before it were; returns the drafts each step carried."""
    rng = random.Random(0)
    carried = []
    for _ in range(steps):
        keep = budget.plan([[0] * draft_len for _ in range(batch)], [0] * batch)
        for kept in keep:
            if kept:
                budget.acceptance.observe(kept, next((i for i in range(kept) if rng.random() >= accept), kept))
        budget.observe(batch + sum(keep), seconds(batch + sum(keep)))
        carried.append(sum(keep))
    return carried


def _knee(at: int, per_token: float) -> Callable[[int], float]:
    """A CPU step: flat while the rows fit the small-batch kernels, then rising with every token."""
    return lambda tokens: 1.0 + per_token * max(0, tokens - at)


def test_where_extra_tokens_cost_little_the_whole_draft_runs() -> None:
    budget = DraftBudget()
    carried = _run(budget, 120, batch=1, draft_len=8, accept=0.75, seconds=_knee(16, 0.1))
    assert carried[-40:].count(8) >= 40 - 40 // EXPLORE_EVERY - 1


def test_drafts_fill_the_step_up_to_the_knee_and_not_past_it() -> None:
    budget = DraftBudget()
    carried = _run(budget, 200, batch=8, draft_len=8, accept=0.75, seconds=_knee(16, 0.125))
    settled = carried[-64:]
    assert sorted(settled)[len(settled) // 2] == 8  # 8 rows + 8 drafts: the knee
    assert max(settled) <= 16  # past it only when exploring: one bucket on


def test_where_drafts_never_pay_they_cost_almost_nothing() -> None:
    budget = DraftBudget()
    step = _knee(0, 1 / 64)  # batch 64: compute-bound, every token its share
    carried = _run(budget, 300, batch=64, draft_len=8, accept=0.0, seconds=step)
    tokens = 300 * 64  # what the run produces with or without drafts: none are accepted
    with_drafts = sum(step(64 + d) for d in carried)
    assert tokens / with_drafts >= 0.97 * tokens / (300 * step(64))
    assert sum(1 for d in carried[-100:] if d) <= 100 // EXPLORE_EVERY + 1


def test_it_follows_a_change_in_acceptance() -> None:
    budget = DraftBudget()
    _run(budget, 100, batch=1, draft_len=8, accept=1.0, seconds=_knee(16, 0.1))
    later = _run(budget, 100, batch=1, draft_len=8, accept=0.0, seconds=lambda tokens: 1.0 + 0.02 * tokens)
    assert sum(1 for d in later[-50:] if d) <= 50 // EXPLORE_EVERY + 1
