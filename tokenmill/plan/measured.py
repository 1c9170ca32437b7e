"""Measured results (``--measured FILE``) and their efficiency against the ceilings.

Accepted JSON (until ``tokenmill bench`` fixes its own format)::

    {"input_len": 2048, "output_len": 512,          # optional: the workload that was run
     "points": [{"batch_size": 32, "output_tokens_per_s": 1510.0,
                 "decode_tokens_per_s": 1600.0,     # optional
                 "prefill_tokens_per_s": 40000.0},  # optional: input tokens / prefill time
                ...]}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError
from .roofline import Plan


@dataclass(frozen=True)
class MeasuredPoint:
    batch_size: int
    output_tokens_per_s: float
    decode_tokens_per_s: float | None = None
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Measured:
    points: tuple[MeasuredPoint, ...]
    input_len: int | None = None
    output_len: int | None = None


@dataclass(frozen=True)
class Efficiency:
    """measured / ceiling; above 1 means the measurement or the plan inputs are wrong."""

    batch_size: int
    output_tokens_per_s: float
    output: float  # vs the back-to-back (prefill then decode) e2e ceiling
    output_overlap: float  # vs the e2e ceiling with prefill hidden under decode
    decode: float | None
    prefill: float | None

    @property
    def above_ceiling(self) -> bool:
        ratios = (self.output_overlap, self.decode, self.prefill)
        return any(r is not None and r > 1 for r in ratios)


def _number(raw: dict[str, Any], key: str, where: str, required: bool) -> float | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise PlanError("measured", f"{where}.{key} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError("measured", f"{where}.{key} must be a positive number, got {value!r}")
    return float(value)


def parse_measured(data: Any) -> Measured:
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise PlanError("measured", 'expected {"points": [...]} at the top level')
    points = []
    for i, raw in enumerate(data["points"]):
        where = f"points[{i}]"
        if not isinstance(raw, dict):
            raise PlanError("measured", f"{where} must be an object")
        batch = _number(raw, "batch_size", where, True)
        if batch is None or batch != int(batch):
            raise PlanError("measured", f"{where}.batch_size must be an integer")
        output = _number(raw, "output_tokens_per_s", where, True)
        assert output is not None
        points.append(MeasuredPoint(int(batch), output,
                                    _number(raw, "decode_tokens_per_s", where, False),
                                    _number(raw, "prefill_tokens_per_s", where, False)))
    lengths = [_number(data, k, "top level", False) for k in ("input_len", "output_len")]
    return Measured(tuple(points), *(int(v) if v else None for v in lengths))


def load_measured(path: str | Path) -> Measured:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanError("measured", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanError("measured", f"{path} is not valid JSON: {exc}") from None
    return parse_measured(data)


def _ratio(measured: float | None, ceiling: float) -> float | None:
    if measured is None or not math.isfinite(ceiling):
        return None
    return measured / ceiling


def efficiencies(plan: Plan, measured: Measured) -> list[Efficiency]:
    """Pair each measured point with the plan point of the same batch size."""
    by_batch = {p.batch_size: p for p in plan.points}
    result = []
    for m in measured.points:
        p = by_batch.get(m.batch_size)
        if p is None:
            raise PlanError("measured", f"batch_size {m.batch_size} is not in the plan's batch "
                            "sizes")
        result.append(Efficiency(
            m.batch_size, m.output_tokens_per_s, m.output_tokens_per_s / p.e2e_tokens_per_s,
            m.output_tokens_per_s / p.e2e_overlap_tokens_per_s,
            _ratio(m.decode_tokens_per_s, p.decode_tokens_per_s),
            _ratio(m.prefill_tokens_per_s, p.prefill_tokens_per_s)))
    return result
