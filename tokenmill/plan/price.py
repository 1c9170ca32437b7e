"""`--price-per-hour`, as every command takes it: a number of $/hour, or a hardware name from the
catalog (its default $/device-hour)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .catalog import CATALOG

FLAG_HELP = "$ per hour, or a hardware name from the planner's catalog (its $/device-hour: " + ", ".join(CATALOG) + ")"


@dataclass(frozen=True)
class HourlyPrice:
    usd: float
    source: str  # "--price-per-hour", or "catalog H200"


def hourly_price(text: str) -> HourlyPrice:
    """ValueError naming the flag for text that is neither a number >= 0 nor a catalog name."""
    try:
        usd = float(text)
    except ValueError:
        spec = CATALOG.get(text.strip().lower())
        if spec is None:
            raise ValueError(f"--price-per-hour: {text!r} is neither a number nor a catalog hardware "
                             f"(known: {', '.join(CATALOG)})") from None
        return HourlyPrice(spec.price_per_hour, f"catalog {spec.name}")
    if not usd >= 0 or usd == float("inf"):
        raise ValueError(f"--price-per-hour: must be a finite number >= 0, got {text}")
    return HourlyPrice(usd, "--price-per-hour")


def hourly_price_arg(text: str) -> HourlyPrice:
    """`hourly_price` as an argparse `type=`: a usage error naming the flag for a bad value."""
    try:
        return hourly_price(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--price-per-hour: ")) from None


def price_per_hour_arg(text: str) -> float:
    """`hourly_price_arg`, for commands that need only the $/hour."""
    return hourly_price_arg(text).usd
