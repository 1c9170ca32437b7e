"""What a cascade did and cost, per tier and in all, beside what the last tier alone would have
cost: summary.json and the table `tokenmill cascade` prints.

A tier's cost is its price applied to what it did: $/hour × the wall time of its runs (model load
excluded, as in `tokenmill run`), or $/M tokens × the tokens of every answer it gave, kept or not.
"The last tier alone" is a projection with its basis stated: the last tier's measured cost per
row, on the rows that reached it, times every row of the job (the rows that reached it were the
ones the cheaper tiers found hard, so this is a projection, not a measurement).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.choose.stats import format_usd


@dataclass
class TierResult:
    name: str
    flags: str
    price: str  # as the user gave it ("$0.1/h", "$0.15/M in · $0.6/M out")
    rows: int = 0  # rows it was given
    answered: int = 0  # rows it answered (kept or not)
    escalated: int = 0  # rows handed to the next tier: answers not accepted, and rows that failed
    failed: int = 0  # rows that failed for good here (a bad line; any failure at the last tier)
    accepted: int = 0  # answers kept at this tier
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float | None = None  # its finished runs, summed
    usd: float | None = None  # None: no price, or not timed
    rejections: dict[str, int] = field(default_factory=dict)  # why answers were not accepted, counted


@dataclass
class LastTierAlone:
    usd: float
    basis: str


@dataclass
class CascadeOutcome:
    input_path: str
    results_path: str
    errors_path: str
    tiers: list[TierResult]
    last_tier_alone: LastTierAlone | None = None

    @property
    def rows(self) -> int:
        return self.tiers[0].rows

    @property
    def usd(self) -> float | None:
        costs = [t.usd for t in self.tiers]
        return None if any(c is None for c in costs) else sum(c for c in costs if c is not None)

    @property
    def saving(self) -> float | None:
        """The share of the last tier alone's cost the cascade did not spend."""
        alone, usd = self.last_tier_alone, self.usd
        if alone is None or usd is None or not alone.usd:
            return None
        return 1 - usd / alone.usd

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows": self.rows, "usd": self.usd, "saving": self.saving}


def last_tier_alone(tiers: list[TierResult]) -> LastTierAlone | None:
    """The whole job on the last tier, at its measured cost per row (None when it answered none,
    or has no cost)."""
    last = tiers[-1]
    if not last.answered or last.usd is None:
        return None
    per_row = last.usd / last.answered
    basis = (f"{last.name}'s measured cost per row ({format_usd(per_row)}, over the {last.answered} rows that "
             f"reached it) × all {tiers[0].rows} rows")
    return LastTierAlone(per_row * tiers[0].rows, basis)


def print_cascade(outcome: CascadeOutcome, console: Console) -> None:
    table = Table(title=f"tokenmill cascade · {outcome.rows} rows", title_justify="left")
    for header in ("tier", "price", "rows in", "answered", "kept", "handed on", "failed", "tokens in/out",
                   "wall", "cost"):
        table.add_column(header, justify="left" if header in ("tier", "price") else "right")
    for t in outcome.tiers:
        table.add_row(t.name, t.price, f"{t.rows}", f"{t.answered}", f"{t.accepted}", f"{t.escalated}",
                      f"{t.failed}", f"{t.prompt_tokens:,}/{t.completion_tokens:,}",
                      "–" if t.wall_s is None else f"{t.wall_s:.1f} s", format_usd(t.usd))
    console.print(table)
    for t in outcome.tiers:
        if t.rejections:
            why = ", ".join(f"{n} {kind}" for kind, n in t.rejections.items())
            console.print(f"{t.name}: not kept: {why}", markup=False, highlight=False, soft_wrap=True)
    total = format_usd(outcome.usd)
    alone = outcome.last_tier_alone
    if alone is None:
        console.print(f"cost {total}; the last tier alone: not measured (no row reached it, or it has no price)")
    else:
        saving = ("" if outcome.saving is None else f" — the cascade saved {outcome.saving:.0%}"
                  if outcome.saving >= 0 else f" — the cascade cost {-outcome.saving:.0%} more")
        console.print(f"cost {total}; the last tier alone {format_usd(alone.usd)}{saving}. Basis: {alone.basis}",
                      markup=False, highlight=False, soft_wrap=True)
    console.print(f"files: {outcome.results_path} · {outcome.errors_path}", markup=False, highlight=False)
