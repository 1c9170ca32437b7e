"""The intervals and the verdict of `tokenmill choose` (tokenmill/choose/stats.py)."""

from __future__ import annotations

import math

import pytest

from tokenmill.choose import stats
from tokenmill.choose.results import DONE, FAILED, INCOMPLETE, CandidateResult, Price, Projection, Quality
from tokenmill.choose.stats import (
    Z95,
    bootstrap_mean,
    decide,
    format_bar,
    format_usd,
    quality,
    rows_to_separate,
    wilson,
)


def cand(name: str, mean: float, low: float, high: float, usd: float | None, status: str = DONE) -> CandidateResult:
    """A candidate that ran 100 rows, with this quality and this projected cost of the whole job."""
    return CandidateResult(
        name=name, flags="", price=Price(per_hour=1.0) if usd is not None else Price(), status=status, rows=100,
        answered=100, quality=Quality(mean=mean, low=low, high=high, method="wilson", n=100),
        projected=Projection(rows=1000, prompt_tokens=1, output_tokens=1, wall_s=1.0, usd=usd),
    )


# --- Wilson ---

def test_wilson_matches_the_published_values() -> None:
    low, high = wilson(7, 10)
    assert (round(low, 4), round(high, 4)) == (0.3968, 0.8922)
    low, high = wilson(1, 1)
    assert (round(low, 4), high) == (0.2065, 1.0)
    low, high = wilson(3, 4)
    assert (round(low, 4), round(high, 4)) == (0.3006, 0.9544)


def test_wilson_is_exact_at_the_ends() -> None:
    low, high = wilson(0, 10)
    assert low == 0.0 and round(high, 4) == 0.2775
    low, high = wilson(10, 10)
    assert round(low, 4) == 0.7225 and high == 1.0
    # Symmetric: k of n and n-k of n mirror each other around 1/2.
    assert wilson(0, 10)[1] == pytest.approx(1 - wilson(10, 10)[0])


def test_wilson_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        wilson(0, 0)
    with pytest.raises(ValueError):
        wilson(11, 10)


# --- bootstrap ---

GRADED = [0.2, 0.5, 0.9]


def test_bootstrap_is_deterministic_for_a_seed() -> None:
    values = GRADED * 10
    assert bootstrap_mean(values, seed=3) == bootstrap_mean(values, seed=3)
    assert bootstrap_mean(values, seed=3) != bootstrap_mean(values, seed=4)


def test_bootstrap_covers_the_mean_and_narrows_with_n() -> None:
    small, large = GRADED * 4, GRADED * 40
    widths = []
    for values in (small, large):
        low, high = bootstrap_mean(values)
        mean = sum(values) / len(values)
        assert low < mean < high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2
    # At n = 120 the mean is near normal: the half-width is about z·sd/sqrt(n) = 0.0513.
    sd = math.sqrt(sum((v - 0.5333333) ** 2 for v in GRADED) / 3)
    assert widths[1] / 2 == pytest.approx(Z95 * sd / math.sqrt(120), abs=0.004)


def test_bootstrap_of_equal_values_is_the_value() -> None:
    assert bootstrap_mean([0.1] * 7) == (0.1, 0.1)
    assert bootstrap_mean([0.4]) == (0.4, 0.4)


def test_bootstrap_in_chunks_gives_the_same_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    values = GRADED * 40
    whole = bootstrap_mean(values, resamples=4000)
    monkeypatch.setattr(stats, "_CHUNK_ELEMENTS", 1000)  # 8 resamples per chunk
    chunked = bootstrap_mean(values, resamples=4000)
    assert chunked == pytest.approx(whole, abs=0.01)
    assert chunked == bootstrap_mean(values, resamples=4000)


def test_bootstrap_refuses_nothing_to_resample() -> None:
    with pytest.raises(ValueError):
        bootstrap_mean([])


# --- quality ---

def test_quality_of_pass_fail_scores_is_wilson() -> None:
    q = quality([1, 0, 1.0, 1])
    assert (q.mean, q.method, q.n) == (0.75, "wilson", 4)
    assert (q.low, q.high) == wilson(3, 4)


def test_quality_of_graded_scores_is_bootstrap() -> None:
    q = quality(GRADED * 4)
    assert q.method == "bootstrap" and q.n == 12
    assert q.mean == pytest.approx(0.5333333333)
    assert (q.low, q.high) == bootstrap_mean(GRADED * 4)


def test_quality_of_no_scores_is_an_error() -> None:
    with pytest.raises(ValueError):
        quality([])


# --- rows_to_separate ---

def test_rows_to_separate_is_where_the_half_width_drops_below_the_gap() -> None:
    n = rows_to_separate(0.85, 0.9)
    assert n == 196  # z² · 0.85 · 0.15 / 0.05² = 195.9
    assert Z95 * math.sqrt(0.85 * 0.15 / n) < 0.05 <= Z95 * math.sqrt(0.85 * 0.15 / (n - 1))
    assert rows_to_separate(0.92, 0.9) == 707
    assert rows_to_separate(0.9, 0.9) is None


def test_rows_to_separate_at_all_pass_uses_the_wilson_bound() -> None:
    # The normal width is 0 at p = 1; 73 of 73 is the first all-pass sample whose Wilson bound clears 0.95.
    assert rows_to_separate(1.0, 0.95) == 73
    assert wilson(73, 73)[0] >= 0.95 > wilson(72, 72)[0]
    assert rows_to_separate(0.0, 0.05) == 73


# --- decide ---

CHEAP = cand("cheap", 0.92, 0.86, 0.96, 1.0)  # clears 0.90 by its mean only
SURE = cand("sure", 0.95, 0.91, 0.98, 5.0)  # clears by both


def test_clearing_by_lower_bound_or_by_mean_chooses_differently() -> None:
    by_lower = decide([CHEAP, SURE], 0.9, "lower")
    assert (by_lower.chosen, by_lower.clears, by_lower.straddles) == ("sure", ("sure",), ("cheap",))
    assert by_lower.message == (
        "sure: the cheapest that clears 0.90 by its lower bound (0.95 [0.91, 0.98]); whole job $5.00 projected. "
        "cheap straddles the bar: sample more (about 707 rows would separate cheap from the bar).")
    by_mean = decide([CHEAP, SURE], 0.9, "mean")
    assert (by_mean.chosen, by_mean.clears, by_mean.straddles) == ("cheap", ("cheap", "sure"), ("cheap",))
    assert by_mean.message.startswith(
        "cheap: the cheapest that clears 0.90 by its mean (0.92 [0.86, 0.96]); whole job $1.00 projected.")
    assert (by_mean.bar, by_mean.clear_by) == (0.9, "mean")


def test_the_cheapest_of_several_that_clear_is_chosen() -> None:
    several = [cand("a", 0.97, 0.93, 0.99, 3.0), cand("b", 0.93, 0.91, 0.95, 1.5), cand("c", 0.99, 0.95, 1.0, 2.0),
               cand("d", 0.80, 0.70, 0.88, 0.1)]
    verdict = decide(several, 0.9, "lower")
    assert verdict.chosen == "b"
    assert verdict.clears == ("a", "b", "c")
    assert verdict.straddles == ()
    assert "straddle" not in verdict.message


def test_a_candidate_of_unknown_cost_cannot_be_chosen() -> None:
    unknown = cand("mystery", 0.99, 0.95, 1.0, None)
    verdict = decide([unknown, cand("weak", 0.5, 0.4, 0.6, 1.0)], 0.9, "lower")
    assert verdict.chosen is None and verdict.clears == ("mystery",)
    assert verdict.message == ("mystery clears 0.90 by its lower bound, but its cost is unknown: "
                               "give it a price to choose.")
    both = decide([unknown, cand("other", 0.97, 0.92, 0.99, None)], 0.9, "lower")
    assert both.message == ("mystery, other clear 0.90 by their lower bound, but their cost is unknown: "
                            "give them a price to choose.")


def test_a_known_cost_is_chosen_and_the_unknown_one_is_named() -> None:
    verdict = decide([cand("mystery", 0.99, 0.95, 1.0, None), SURE], 0.9, "lower")
    assert verdict.chosen == "sure"
    assert verdict.message.endswith("mystery also clears at an unknown cost: give it a price to compare.")


def test_no_projection_counts_as_unknown_cost() -> None:
    c = cand("unprojected", 0.99, 0.95, 1.0, 1.0)
    c.projected = None
    assert decide([c], 0.9, "lower").chosen is None


def test_ties_go_to_the_better_then_by_name() -> None:
    better = cand("zz-better", 0.96, 0.92, 0.99, 2.0)
    assert decide([SURE, cand("worse", 0.94, 0.91, 0.97, 5.0)], 0.9, "lower").chosen == "sure"
    assert decide([cand("b", 0.95, 0.92, 0.98, 2.0), better], 0.9, "lower").chosen == "zz-better"
    twins = [cand("b", 0.95, 0.92, 0.98, 2.0), cand("a", 0.95, 0.92, 0.98, 2.0)]
    assert decide(twins, 0.9, "lower").chosen == "a"
    assert decide(twins[::-1], 0.9, "lower").chosen == "a"


def test_a_candidate_exactly_at_the_bar_clears_by_mean_and_straddles() -> None:
    at_bar = cand("edge", 0.9, 0.85, 0.95, 1.0)
    by_mean = decide([at_bar], 0.9, "mean")
    assert (by_mean.chosen, by_mean.clears, by_mean.straddles) == ("edge", ("edge",), ("edge",))
    assert by_mean.message.endswith(
        "edge straddles the bar: sample more (edge sits on the bar and cannot be separated from it).")
    by_lower = decide([at_bar], 0.9, "lower")
    assert (by_lower.chosen, by_lower.clears, by_lower.straddles) == (None, (), ("edge",))


def test_a_lower_bound_exactly_at_the_bar_clears() -> None:
    verdict = decide([cand("just", 0.95, 0.9, 0.98, 1.0)], 0.9, "lower")
    assert verdict.chosen == "just" and verdict.straddles == ()


def test_failed_and_incomplete_candidates_take_no_part() -> None:
    failed = cand("broken", 0.99, 0.97, 1.0, 0.01, status=FAILED)
    incomplete = cand("halfway", 0.99, 0.97, 1.0, 0.01, status=INCOMPLETE)
    unscored = cand("unscored", 0.0, 0.0, 0.0, 0.01)
    unscored.quality = None
    verdict = decide([failed, incomplete, unscored, SURE], 0.9, "lower")
    assert (verdict.chosen, verdict.clears, verdict.straddles) == ("sure", ("sure",), ())
    assert not any(name in verdict.message for name in ("broken", "halfway", "unscored"))


def test_when_none_clears_the_best_is_named_and_straddlers_told_to_sample_more() -> None:
    far = cand("far", 0.6, 0.5, 0.7, 1.0)
    close = cand("close", 0.85, 0.80, 0.89, 2.0)
    verdict = decide([far, close], 0.9, "lower")
    assert (verdict.chosen, verdict.clears, verdict.straddles) == (None, (), ())
    assert verdict.message == ("no candidate clears 0.90 by its lower bound; the best by its lower bound "
                               "is close (0.85 [0.80, 0.89]).")
    near = cand("near", 0.85, 0.78, 0.91, 1.0)
    verdict = decide([far, near, cand("nearer", 0.88, 0.82, 0.93, 1.0)], 0.9, "lower")
    assert verdict.straddles == ("near", "nearer")
    assert verdict.message.endswith(
        "near, nearer straddle the bar: sample more (about 196 rows would separate near from the bar; "
        "about 1,015 rows would separate nearer from the bar).")  # z² · 0.88 · 0.12 / 0.02² = 1,014.1
    twin = cand("twin", 0.85, 0.79, 0.90, 1.0)  # the same mean as near: one clause names both
    verdict = decide([near, twin, cand("on", 0.9, 0.8, 0.95, 1.0), cand("also-on", 0.9, 0.85, 0.95, 1.0)], 0.9, "lower")
    assert verdict.message.endswith(
        "near, twin, on, also-on straddle the bar: sample more (about 196 rows would separate near, twin from the "
        "bar; on, also-on sit on the bar and cannot be separated from it).")


def test_none_finished() -> None:
    verdict = decide([cand("broken", 0.99, 0.97, 1.0, 0.01, status=FAILED)], 0.9, "mean")
    assert verdict.message == "no candidate clears 0.90 by its mean: none finished its sample."


def test_an_unknown_clear_by_is_refused() -> None:
    with pytest.raises(ValueError, match="clear_by"):
        decide([SURE], 0.9, "upper")


# --- formatting shared with the report ---

def test_money_and_bar_formats() -> None:
    assert [format_usd(x) for x in (None, 0.0, 0.0042, 0.05, 0.123, 1.234, 1234.5)] == [
        "–", "$0.00", "$0.0042", "$0.050", "$0.12", "$1.23", "$1,234.50"]
    assert (format_bar(0.9), format_bar(0.925), format_bar(1.0)) == ("0.90", "0.925", "1.00")
