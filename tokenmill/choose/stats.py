"""How good a candidate is, how sure we are, and which one to choose.

- Pass/fail scores (every score 0 or 1): the Wilson score interval, which stays inside [0, 1] and
  keeps its coverage on small samples and at 0/n or n/n, where the normal interval collapses.
- Graded scores: a percentile bootstrap of the mean (numpy only, seeded, so a report reproduces).
- The verdict: among the candidates that finished, the cheapest (by the projected cost of the
  whole job) whose quality clears the bar, by its interval's lower bound or by its mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tokenmill.choose.results import CLEAR_BY, DONE, CandidateResult, Quality, Verdict

Z95 = 1.959963984540054  # the two-sided 95% normal quantile
# The most resampled indices held at once in bootstrap_mean (int64: 32 MiB).
_CHUNK_ELEMENTS = 1 << 22


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for `successes` out of `n`."""
    if n <= 0:
        raise ValueError("the Wilson interval needs n >= 1")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0/n and n/n the bound is 0 or 1 in exact arithmetic; floating point can miss by an ulp.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def bootstrap_mean(
    values: Sequence[float], resamples: int = 10_000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean of `values` (deterministic for a seed)."""
    if not values:
        raise ValueError("the bootstrap needs at least one value")
    if resamples < 1 or not 0 < confidence < 1:
        raise ValueError("resamples must be >= 1 and confidence in (0, 1)")
    data = np.asarray(values, dtype=float)
    if np.all(data == data[0]):
        # Every resample's mean is the value itself; summing could still be off by an ulp.
        return float(data[0]), float(data[0])
    means = _resampled_means(data, resamples, np.random.default_rng(seed))
    alpha = 1 - confidence
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _resampled_means(data: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    n = len(data)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // n)  # bounds memory whatever the sample size
    chunks = []
    for start in range(0, resamples, rows_per_chunk):
        rows = min(rows_per_chunk, resamples - start)
        index = rng.integers(0, n, size=(rows, n))
        chunks.append(data[index].mean(axis=1))
    return np.concatenate(chunks)


def quality(scores: Sequence[float]) -> Quality:
    """The mean score and its 95% interval: Wilson for pass/fail scores, bootstrap for graded."""
    if not scores:
        raise ValueError("no scores: quality needs at least one scored row")
    n = len(scores)
    mean = math.fsum(scores) / n
    if all(s in (0, 1) for s in scores):
        low, high = wilson(round(math.fsum(scores)), n)
        return Quality(mean=mean, low=low, high=high, method="wilson", n=n)
    low, high = bootstrap_mean(scores)
    return Quality(mean=mean, low=low, high=high, method="bootstrap", n=n)


def rows_to_separate(mean: float, bar: float, z: float = Z95) -> int | None:
    """About how many rows would make the 95% interval around `mean` leave out `bar`, were the mean to
    stay where it is: the least N with z·sqrt(p(1-p)/N) < |mean - bar|. None when mean == bar."""
    gap = abs(mean - bar)
    if gap == 0:
        return None
    variance = mean * (1 - mean)
    if variance <= 0:
        # All 0 or all 1: the normal width is 0 at any N; use where the Wilson bound passes the bar
        # (n/(n+z²) > bar at mean 1; z²/(n+z²) < bar at mean 0).
        odds = bar / (1 - bar) if mean >= 1 else (1 - bar) / bar
        return math.floor(z * z * odds) + 1
    return math.floor(z * z * variance / (gap * gap)) + 1


def clears(q: Quality, bar: float, clear_by: str) -> bool:
    """Whether quality `q` clears `bar` by its lower bound ("lower") or its mean ("mean")."""
    return (q.low if clear_by == "lower" else q.mean) >= bar


def straddles(q: Quality, bar: float) -> bool:
    """Whether the interval contains the bar, so that more rows could tell which side it is on."""
    return q.low < bar <= q.high


def decide(candidates: Sequence[CandidateResult], bar: float, clear_by: str) -> Verdict:
    """The cheapest candidate whose quality clears `bar`; only finished candidates take part."""
    if clear_by not in CLEAR_BY:
        raise ValueError(f"clear_by must be one of {', '.join(CLEAR_BY)}, got {clear_by!r}")
    judged = [c for c in candidates if c.status == DONE and c.quality is not None]
    clearing = [c for c in judged if clears(_q(c), bar, clear_by)]
    straddling = [c for c in judged if straddles(_q(c), bar)]
    priced = [c for c in clearing if _usd(c) is not None]
    # Cheapest; then the better; then by name, so that the choice never depends on the order given.
    chosen = min(priced, key=lambda c: (_usd(c), -_q(c).mean, c.name)) if priced else None
    sentences = [_headline(judged, clearing, chosen, bar, clear_by)]
    if chosen is not None and len(priced) < len(clearing):
        unpriced = [c.name for c in clearing if _usd(c) is None]
        sentences.append(f"{_names(unpriced)} also {_agree(unpriced, 'clears', 'clear')} at an unknown cost: "
                         f"give {_agree(unpriced, 'it', 'them')} a price to compare.")
    if straddling:
        sentences.append(_straddle_sentence(straddling, bar))
    return Verdict(bar=bar, clear_by=clear_by, chosen=chosen.name if chosen else None,
                   clears=tuple(c.name for c in clearing), straddles=tuple(c.name for c in straddling),
                   message=" ".join(sentences))


def _headline(judged: list[CandidateResult], clearing: list[CandidateResult], chosen: CandidateResult | None,
              bar: float, clear_by: str) -> str:
    basis = basis_phrase(clear_by)
    if chosen is not None:
        return (f"{chosen.name}: the cheapest that clears {format_bar(bar)} by its {basis} "
                f"({format_quality(_q(chosen))}); whole job {format_usd(_usd(chosen))} projected.")
    if clearing:
        names = [c.name for c in clearing]
        their = _agree(names, "its", "their")
        return (f"{_names(names)} {_agree(names, 'clears', 'clear')} {format_bar(bar)} by {their} {basis}, "
                f"but {their} cost is unknown: give {_agree(names, 'it', 'them')} a price to choose.")
    if not judged:
        return f"no candidate clears {format_bar(bar)} by its {basis}: none finished its sample."
    best = max(judged, key=lambda c: (_q(c).low if clear_by == "lower" else _q(c).mean, _q(c).mean, c.name))
    return (f"no candidate clears {format_bar(bar)} by its {basis}; the best by its {basis} is "
            f"{best.name} ({format_quality(_q(best))}).")


def _straddle_sentence(straddling: list[CandidateResult], bar: float) -> str:
    names = [c.name for c in straddling]
    by_rows: dict[int | None, list[str]] = {}  # candidates at the same distance from the bar share a clause
    for c in straddling:
        by_rows.setdefault(rows_to_separate(_q(c).mean, bar), []).append(c.name)
    clauses = [f"{_names(group)} {_agree(group, 'sits', 'sit')} on the bar and cannot be separated from it"
               if rows is None else f"about {rows:,} rows would separate {_names(group)} from the bar"
               for rows, group in by_rows.items()]
    return f"{_names(names)} {_agree(names, 'straddles', 'straddle')} the bar: sample more ({'; '.join(clauses)})."


def _q(c: CandidateResult) -> Quality:
    assert c.quality is not None  # only judged candidates get here
    return c.quality


def _usd(c: CandidateResult) -> float | None:
    return None if c.projected is None else c.projected.usd


def _names(names: list[str]) -> str:
    return ", ".join(names)


def _agree(names: list[str], one: str, many: str) -> str:
    """The word for one name or for several: clears/clear, it/them."""
    return one if len(names) == 1 else many


def basis_phrase(clear_by: str) -> str:
    """What is compared with the bar, in words: "lower bound" or "mean"."""
    return "lower bound" if clear_by == "lower" else "mean"


def format_quality(q: Quality) -> str:
    """0.70 [0.40, 0.89]"""
    return f"{q.mean:.2f} [{q.low:.2f}, {q.high:.2f}]"


def format_bar(bar: float) -> str:
    """0.90, as the qualities are written; more digits only where the bar has them (0.925)."""
    return f"{bar:.2f}" if round(bar, 2) == bar else f"{bar:g}"


def format_usd(usd: float | None) -> str:
    """Cents from 10 cents up ($1,234.50, $0.12); two significant digits below ($0.0042)."""
    if usd is None:
        return "–"
    if usd == 0 or abs(usd) >= 0.1:
        return f"${usd:,.2f}"
    digits = 1 - math.floor(math.log10(abs(usd)))
    return f"${usd:.{digits}f}"
