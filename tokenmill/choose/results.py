"""What `tokenmill choose` found: per candidate its quality, speed and cost, and the verdict. The
runner (runner.py) fills these, stats.py decides, report.py prints and draws them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.cost import MILLION, usd_for

# CandidateResult.status
DONE, INCOMPLETE, FAILED = "done", "incomplete", "failed"
# Verdict.clear_by
CLEAR_BY = ("lower", "mean")


@dataclass(frozen=True)
class Price:
    """What a candidate costs: the hardware it runs on by the hour, or a hosted API by the token."""

    per_hour: float | None = None  # $/hour
    per_m_input: float | None = None  # $ per million prompt tokens
    per_m_output: float | None = None  # $ per million completion tokens

    def __post_init__(self) -> None:
        by_token = (self.per_m_input, self.per_m_output)
        if self.per_hour is not None and any(p is not None for p in by_token):
            raise ValueError("a candidate is priced by the hour or by the token, not both")
        if (by_token[0] is None) != (by_token[1] is None):
            raise ValueError("a price by the token needs both --price-per-m-input and --price-per-m-output")
        if any(p is not None and p < 0 for p in (self.per_hour, *by_token)):
            raise ValueError("prices must be >= 0")

    @property
    def known(self) -> bool:
        return self.per_hour is not None or self.per_m_output is not None

    def describe(self) -> str:
        if self.per_hour is not None:
            return f"${self.per_hour:g}/h"
        if self.per_m_output is not None:
            return f"${self.per_m_input:g}/M in · ${self.per_m_output:g}/M out"
        return "unknown"

    def cost(self, wall_s: float | None, prompt_tokens: float, output_tokens: float) -> float | None:
        """$ for work that took `wall_s` (by the hour) or used these tokens (by the token); None if unknown."""
        if self.per_hour is not None:
            return None if wall_s is None else usd_for(self.per_hour, wall_s)
        if self.per_m_input is not None and self.per_m_output is not None:
            return (prompt_tokens * self.per_m_input + output_tokens * self.per_m_output) / MILLION
        return None


@dataclass(frozen=True)
class Quality:
    """The mean score over the sample (failed rows count as 0) and its 95% interval."""

    mean: float
    low: float
    high: float
    method: str  # "wilson" (every score 0 or 1) | "bootstrap" (graded scores)
    n: int  # rows scored: the whole sample


@dataclass(frozen=True)
class Projection:
    """The whole job on this candidate: token counts from the full file, time and cost from the
    rates measured on the sample."""

    rows: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float | None  # None when nothing was timed
    usd: float | None  # None when the price is unknown


@dataclass(frozen=True)
class Ceiling:
    """The planner's ceiling for an embedded candidate on other hardware: a bound, not a measurement."""

    hardware: str
    batch_size: int
    output_tok_s: float
    usd_per_m_output: float | None
    job_usd: float | None


@dataclass(frozen=True)
class CascadeDetail:
    """A cascade candidate (cascades.py): its tiers, its checks and where the sample's rows went."""

    tiers: tuple[str, ...]
    accept: str  # the checks, with their thresholds
    reached: tuple[int, ...]  # sample rows each tier had to answer
    calibrated: float | None  # the threshold choose found for the check given without one


@dataclass
class CandidateResult:
    name: str
    flags: str  # the `tokenmill run` flags it ran with
    price: Price
    backend: str = ""  # embedded | endpoint (the job's backend kind)
    model: str = ""
    status: str = DONE  # DONE | INCOMPLETE (rows not done; re-run resumes) | FAILED (could not run)
    reason: str | None = None  # why not DONE
    rows: int = 0  # rows in the sample
    answered: int = 0  # rows with a result
    failed: int = 0  # rows with a final error (scored 0)
    quality: Quality | None = None
    notes: dict[str, int] = field(default_factory=dict)  # why rows scored below 1, counted
    prompt_tokens: int = 0  # over the answered rows, from their usage
    output_tokens: int = 0
    output_tok_s: float | None = None  # completion tokens ÷ wall time of the runs that finished
    prefill_tok_s: float | None = None  # embedded only
    usd_per_m_output: float | None = None  # what the sample cost ÷ its output tokens, in millions
    projected: Projection | None = None
    ceiling: Ceiling | None = None
    cascade: CascadeDetail | None = None  # a cascade of other candidates


@dataclass(frozen=True)
class Verdict:
    bar: float
    clear_by: str  # "lower": the 95% interval's lower bound clears the bar; "mean": the mean does
    chosen: str | None  # the cheapest candidate that clears (by the projected cost of the whole job)
    clears: tuple[str, ...]
    straddles: tuple[str, ...]  # their interval contains the bar: sample more to know
    message: str


@dataclass
class ChooseReport:
    job: str
    job_rows: int  # good rows in the whole job
    sample: int  # rows in the sample
    seed: int
    scorer: str
    candidates: list[CandidateResult]
    verdict: Verdict
    hardware: str | None = None  # --hardware: ceilings are on this
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))  # tuples as lists: what reading the file back gives
