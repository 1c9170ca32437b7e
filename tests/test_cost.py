"""The money formulas every report uses (tokenmill/cost.py)."""

from __future__ import annotations

import pytest

from tokenmill.cost import millions_per_usd, usd_for, usd_per_hour, usd_per_million


def test_cost_formula() -> None:
    # The study's second-source example: $25/h at 6,000 tok/s is about $1.16 per million.
    assert usd_per_million(25, 6000) == pytest.approx(25 / (6000 * 3600) * 1e6)
    assert round(usd_per_million(25, 6000) or 0, 2) == 1.16
    assert millions_per_usd(25, 6000) == pytest.approx(1 / 1.1574, rel=1e-4)
    assert usd_per_million(1.0, 0) is None


def test_inverse_and_free_hardware() -> None:
    assert usd_per_hour(usd_per_million(25, 6000) or 0, 6000) == pytest.approx(25)
    assert usd_for(3.6, 1800) == pytest.approx(1.8)  # half an hour
    assert usd_per_million(0.0, 100) == 0.0
    assert millions_per_usd(0.0, 100) is None  # a free machine: no "per dollar"
