"""Metric math for `tokenmill bench`: pure functions over per-request timelines.

Every time is in seconds, measured with one monotonic clock, relative to the start of the
run (the moment the first request was offered). Definitions (also in docs/bench.md):

- TTFT = first_token - start (queueing included: it is what the caller waits).
- E2E = end - start.
- TPOT = (E2E - TTFT) / (output_tokens - 1); undefined for one-token outputs.
- per-request output tok/s = output_tokens / E2E (what one caller sees, TTFT included).
- percentile: linear interpolation between closest ranks, numpy's default ("linear").
- $/M tokens = price_per_hour / (tokens_per_s x 3600) x 1e6 (tokenmill/cost.py).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request's timeline and shape, times relative to the run's start."""

    request_id: str
    input_len_requested: int
    output_len_requested: int
    input_tokens: int  # as counted by the target (engine, or the server's usage)
    output_tokens: int
    cached_tokens: int
    start: float  # when the request was offered (sent / added)
    first_token: float | None
    end: float | None
    token_times: list[float] = field(default_factory=list)  # one per output token (or chunk)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None and self.end is not None


def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token is None else r.first_token - r.start


def e2e(r: RequestRecord) -> float | None:
    return None if r.end is None else r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    """Mean time per output token after the first: (E2E - TTFT) / (output_tokens - 1)."""
    t, total = ttft(r), e2e(r)
    if t is None or total is None or r.output_tokens < 2:
        return None
    return (total - t) / (r.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks, like numpy's
    default: rank = q/100 x (n - 1), value = v[floor] + (v[ceil] - v[floor]) x frac."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    v = sorted(values)
    rank = q / 100 * (len(v) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def _rate(tokens: float, seconds: float | None) -> float | None:
    return tokens / seconds if seconds and seconds > 0 and tokens > 0 else None


def phase_rates(records: list[RequestRecord]) -> tuple[float | None, float | None, float]:
    """(prefill tok/s, decode tok/s, prefill_end) from the client-side timelines.

    Prefill phase = run start .. the last request's first token: every prompt has been read by
    then. Prefill tok/s = all prompt tokens / that time; decode steps that continuous batching
    interleaves in that window are charged to prefill, so this is a lower bound.
    Decode phase = prefill_end .. the last token. Decode tok/s = the output tokens whose
    timestamp falls in that window / its length: only tokens produced after every prompt was
    done count, so nothing made during prefill inflates it.
    """
    done = [r for r in records if r.ok]
    if not done:
        return None, None, 0.0
    prefill_end = max(r.first_token for r in done)  # type: ignore[type-var]
    prefill = _rate(sum(r.input_tokens for r in done), prefill_end)
    last = max(r.end for r in done)  # type: ignore[type-var]
    in_window = sum(_tokens_after(r, prefill_end) for r in done)
    return prefill, _rate(in_window, last - prefill_end), prefill_end


def _tokens_after(r: RequestRecord, t0: float) -> float:
    """Output tokens produced after t0; chunk timestamps are scaled to the token count."""
    if not r.token_times:
        return 0.0
    after = sum(1 for t in r.token_times if t > t0)
    return after * r.output_tokens / len(r.token_times)


@dataclass
class PointResult:
    """One run (or the median of several runs) at one batch size."""

    batch_size: int
    num_requests: int
    num_failed: int
    wall_s: float
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    per_request_output_tokens_per_s: float | None  # median over requests
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p95: float | None
    e2e_p50: float | None
    e2e_p95: float | None
    input_len_mean: float  # shape check: actual (requested is in the workload)
    output_len_mean: float
    shape_mismatches: int  # requests whose actual lengths differ from the requested ones
    peak_kv_usage: float | None = None  # embedded only
    preemptions: int | None = None  # embedded only
    other_cpu_s: float | None = None  # CPU seconds used by other processes during the run
    gain: float | None = None  # output tok/s vs the previous batch size, -1..inf


def summarize(batch_size: int, records: list[RequestRecord], wall_s: float) -> PointResult:
    """Aggregate one run. Throughputs are over the run's wall time (first offer .. last token)."""
    done = [r for r in records if r.ok]
    inp = sum(r.input_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    ttfts = [x for r in done if (x := ttft(r)) is not None]
    tpots = [x for r in done if (x := tpot(r)) is not None]
    e2es = [x for r in done if (x := e2e(r)) is not None]
    per_req = [r.output_tokens / x for r in done if (x := e2e(r))]
    prefill, decode, _ = phase_rates(done)
    wall = max(wall_s, 1e-9)
    mismatches = sum(1 for r in done if (r.input_tokens, r.output_tokens)
                     != (r.input_len_requested, r.output_len_requested))
    return PointResult(
        batch_size, len(records), len(records) - len(done), wall_s, inp, out,
        sum(r.cached_tokens for r in done), out / wall, (inp + out) / wall, len(done) / wall,
        statistics.median(per_req) if per_req else None, prefill, decode,
        percentile(ttfts, 50), percentile(ttfts, 95), percentile(ttfts, 99),
        percentile(tpots, 50), percentile(tpots, 95), percentile(e2es, 50), percentile(e2es, 95),
        inp / len(done) if done else 0.0, out / len(done) if done else 0.0, mismatches,
    )


# Fields that are counts or settings, not measurements: the median run keeps them as they are.
_NOT_MEDIANED = {"batch_size", "gain"}


def median_point(runs: list[PointResult]) -> PointResult:
    """Field-wise median over runs (each metric's own median, as the study reports)."""
    if not runs:
        raise ValueError("no runs to take the median of")
    values: dict[str, object] = {}
    for name in PointResult.__dataclass_fields__:
        column = [getattr(r, name) for r in runs]
        present = [c for c in column if c is not None]
        if name in _NOT_MEDIANED or not present:
            values[name] = column[0]
        else:
            m = statistics.median(present)
            values[name] = round(m) if isinstance(present[0], int) and not isinstance(m, int) else m
    return PointResult(**values)  # type: ignore[arg-type]


def add_gains(points: list[PointResult]) -> None:
    """Gain in total output tok/s over the previous (smaller) batch size."""
    for prev, cur in itertools.pairwise(points):
        if prev.output_tokens_per_s > 0:
            cur.gain = cur.output_tokens_per_s / prev.output_tokens_per_s - 1
