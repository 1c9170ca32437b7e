"""A cascade as a `tokenmill choose` candidate:

    --candidate "local-then-api=cascade:local,api --accept min-logprob"

Its tiers are other candidates of the same run, which answer every sample row anyway; the cascade
is scored on their answers, with nothing more run: each row takes the first tier's answer that
passes the checks (choose/acceptance.py), else the last tier's. Its cost on the sample is each
tier's cost on the rows that reached it (by the token: their usage; by the hour: their share of
the tier's measured time, prefill and decode scaled by their own tokens); the whole job is each
tier's projection times the share of its sample cost the cascade spent.

A confidence check without its threshold is calibrated: every threshold that changes which rows
go on (each value the statistic takes on the sample) is tried, and the cheapest whose quality
clears the bar is kept (if none clears, the best). The quality is then measured on the sample the
threshold was picked on, so it flatters a little: docs/cascade.md says how to check it on fresh
rows (`tokenmill cascade` on a second labelled sample).
"""

from __future__ import annotations

import shlex
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenmill.choose.acceptance import Acceptance, AcceptanceError, Check
from tokenmill.choose.candidates import NAME, CandidateError
from tokenmill.choose.results import DONE, INCOMPLETE, CandidateResult, CascadeDetail, Price, Projection
from tokenmill.choose.runs import projected_wall
from tokenmill.choose.scorers import Score
from tokenmill.choose.stats import clears, quality
from tokenmill.cost import MILLION
from tokenmill.jobs.results import usage_of

PREFIX = "cascade:"


@dataclass(frozen=True)
class CascadeSpec:
    name: str
    tiers: tuple[str, ...]  # candidate names, cheapest first
    accept: tuple[str, ...]  # the --accept checks, as written

    @property
    def flags_text(self) -> str:
        return f"{PREFIX}{','.join(self.tiers)} " + " ".join(f"--accept {shlex.quote(a)}" for a in self.accept)


def is_cascade(text: str) -> bool:
    return text.partition("=")[2].lstrip().startswith(PREFIX)


def parse_cascade(text: str, candidates: Sequence[str]) -> CascadeSpec:
    """`NAME=cascade:T1,T2 --accept CHECK …` → a CascadeSpec whose tiers are among `candidates`."""
    name, _, rest = text.partition("=")
    name = name.strip()
    if not NAME.fullmatch(name):
        raise CandidateError(f"--candidate {text!r}: NAME of letters, digits, '.', '_' or '-'")
    words = shlex.split(rest)
    tiers = tuple(t for t in words[0][len(PREFIX):].split(",") if t)
    if len(tiers) < 2:
        raise CandidateError(f"--candidate {name}: a cascade needs at least two tiers, e.g. cascade:small,big")
    unknown = [t for t in tiers if t not in candidates]
    if unknown:
        raise CandidateError(f"--candidate {name}: no candidate named {', '.join(unknown)} (a tier is another "
                             f"--candidate of this run: {', '.join(candidates) or 'none'})")
    if len(set(tiers)) < len(tiers):
        raise CandidateError(f"--candidate {name}: a tier appears twice in {','.join(tiers)}")
    accept = words[1:]
    if len(accept) < 2 or accept[::2] != ["--accept"] * (len(accept) // 2) or len(accept) % 2:
        raise CandidateError(f"--candidate {name}: after cascade:TIERS, give only --accept CHECK (one or more)")
    return CascadeSpec(name, tiers, tuple(accept[1::2]))


@dataclass(frozen=True)
class TierEvidence:
    """What one tier candidate did on the sample, row by row."""

    result: CandidateResult
    bodies: dict[str, dict[str, Any]]  # custom_id → its answer's response body (rows it answered)
    scores: dict[str, Score]
    timing: dict[str, float]  # its runs, summed (runs.timed)

    def row_cost(self, custom_id: str) -> float | None:
        prompt, _, output = usage_of(self.bodies[custom_id])
        return self.result.price.cost(projected_wall(self.timing, prompt, output), prompt, output)


@dataclass(frozen=True)
class _Routed:
    scores: list[float]
    notes: Counter[str]
    reached: list[list[str]]  # per tier, the rows it had to answer
    failed: int  # rows the last tier did not answer either


def evaluate(spec: CascadeSpec, tiers: list[TierEvidence], checks: list[Acceptance], ids: list[str], bar: float,
             clear_by: str) -> CandidateResult:
    """The cascade's result on the sample; a calibrated check gets the cheapest threshold that clears."""
    result = CandidateResult(spec.name, spec.flags_text, Price(), backend="cascade",
                             model=" → ".join(t.result.model.rstrip("/").rsplit("/", 1)[-1] for t in tiers),
                             rows=len(ids))
    if unfinished := [t.result.name for t in tiers if t.result.status != DONE]:
        result.status, result.reason = INCOMPLETE, f"tier(s) not done: {', '.join(unfinished)}"
        return result
    calibrated = [c for c in checks[0].checks if c.calibrated]
    try:
        if calibrated:
            checks, threshold = _calibrate(calibrated[0], tiers, checks, ids, bar, clear_by)
        routed = _route(tiers, checks, ids)
    except AcceptanceError as exc:
        result.status, result.reason = INCOMPLETE, str(exc)
        return result
    _fill(result, routed, tiers, ids)
    result.cascade = CascadeDetail(
        tiers=spec.tiers, accept=checks[0].describe(), reached=tuple(len(r) for r in routed.reached),
        calibrated=threshold if calibrated else None)
    return result


def _route(tiers: list[TierEvidence], checks: list[Acceptance], ids: list[str]) -> _Routed:
    """Each row through the tiers, as `tokenmill cascade` would send it."""
    scores, notes, failed = [], Counter[str](), 0
    reached: list[list[str]] = [[] for _ in tiers]
    for custom_id in ids:
        for k, tier in enumerate(tiers):
            reached[k].append(custom_id)
            body = tier.bodies.get(custom_id)
            if k == len(tiers) - 1 or (body is not None and checks[k].rejects(body) is None):
                score = tier.scores.get(custom_id) or Score(0.0, "failed" if body is None else "not scored")
                scores.append(score.value)
                failed += body is None
                if score.note:
                    notes[score.note] += 1
                break
    return _Routed(scores, notes, reached, failed)


def _calibrate(check: Check, tiers: list[TierEvidence], checks: list[Acceptance], ids: list[str], bar: float,
               clear_by: str) -> tuple[list[Acceptance], float]:
    """The checks with `check`'s threshold set: the cheapest on the sample that clears the bar."""
    assert check.statistic is not None
    values = {check.statistic(body, "") for tier in tiers[:-1] for body in tier.bodies.values()}
    trials = []
    for threshold in sorted(values):
        trial = [_with_threshold(a, check, threshold) for a in checks]
        routed = _route(tiers, trial, ids)
        q = quality(routed.scores)
        trials.append((clears(q, bar, clear_by), _sample_cost(routed, tiers), q.mean, threshold, trial))
    clearing = [t for t in trials if t[0]]
    # The cheapest that clears (then the better); with none clearing, the best (then the cheaper).
    best = (min(clearing, key=lambda t: (t[1], -t[2], t[3])) if clearing
            else min(trials, key=lambda t: (-t[2], t[1], t[3])))
    return best[4], best[3]


def _with_threshold(acceptance: Acceptance, check: Check, threshold: float) -> Acceptance:
    return Acceptance(tuple(replace(c, threshold=threshold) if c == check else c for c in acceptance.checks))


def _sample_cost(routed: _Routed, tiers: list[TierEvidence]) -> float:
    """What the rows cost (unknown costs count as 0: then cost cannot rank, and quality does)."""
    return sum(tier.row_cost(i) or 0.0 for tier, rows in zip(tiers, routed.reached, strict=True)
               for i in rows if i in tier.bodies)


def _fill(result: CandidateResult, routed: _Routed, tiers: list[TierEvidence], ids: list[str]) -> None:
    result.quality = quality(routed.scores)
    result.notes = dict(routed.notes.most_common())
    result.failed = routed.failed
    result.answered = len(ids) - routed.failed
    usd: float | None = 0.0
    projected: Projection | None = Projection(0, 0, 0, 0.0, 0.0)
    for tier, rows in zip(tiers, routed.reached, strict=True):
        answered = [i for i in rows if i in tier.bodies]
        for i in answered:
            prompt, _, output = usage_of(tier.bodies[i])
            result.prompt_tokens += prompt
            result.output_tokens += output
        share = _share(tier, answered)
        costs = [tier.row_cost(i) for i in answered]
        usd = None if usd is None or any(c is None for c in costs) else usd + sum(c for c in costs if c is not None)
        projected = _add(projected, tier.result.projected, share)
    result.usd_per_m_output = usd / result.output_tokens * MILLION if usd is not None and result.output_tokens else None
    first = tiers[0].result.projected
    result.projected = replace(projected, rows=first.rows) if projected is not None and first is not None else None


def _share(tier: TierEvidence, rows: list[str]) -> float:
    """The part of the tier's sample cost these rows are (by output tokens where cost is unknown)."""
    weigh: Callable[[str], float | None] = tier.row_cost
    if any(weigh(i) is None for i in tier.bodies):
        weigh = lambda i: float(usage_of(tier.bodies[i])[2])  # noqa: E731
    total = sum(weigh(i) or 0.0 for i in tier.bodies)
    return sum(weigh(i) or 0.0 for i in rows) / total if total else 0.0


def _add(into: Projection | None, tier: Projection | None, share: float) -> Projection | None:
    if into is None or tier is None:
        return None
    wall = None if into.wall_s is None or tier.wall_s is None else into.wall_s + tier.wall_s * share
    usd = None if into.usd is None or tier.usd is None else into.usd + tier.usd * share
    return Projection(into.rows, into.prompt_tokens + round(tier.prompt_tokens * share),
                      into.output_tokens + round(tier.output_tokens * share), wall, usd)

