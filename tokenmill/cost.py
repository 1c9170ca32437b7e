"""The money formulas, written once: cost per million tokens = $/hour ÷ (millions of tokens per hour).

Used by the job summary, `tokenmill generate`, the benchmark reports and the planner.
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600
MILLION = 1e6


def usd_per_million(price_per_hour: float, tokens_per_s: float) -> float | None:
    """$ per million tokens at a steady `tokens_per_s` on hardware costing `price_per_hour`;
    None when no tokens flowed."""
    if tokens_per_s <= 0:
        return None
    return price_per_hour / (tokens_per_s * SECONDS_PER_HOUR / MILLION)


def millions_per_usd(price_per_hour: float, tokens_per_s: float) -> float | None:
    """Millions of tokens one dollar buys; None when nothing flowed or the hardware is free."""
    if tokens_per_s <= 0 or price_per_hour <= 0:
        return None
    return tokens_per_s * SECONDS_PER_HOUR / MILLION / price_per_hour


def usd_per_hour(usd_per_million_tokens: float, tokens_per_s: float) -> float:
    """The inverse: the $/hour that a stated $/M at a stated rate implies."""
    return usd_per_million_tokens * tokens_per_s * SECONDS_PER_HOUR / MILLION


def usd_for(price_per_hour: float, seconds: float) -> float:
    """What `seconds` of hardware at `price_per_hour` cost."""
    return price_per_hour * seconds / SECONDS_PER_HOUR
