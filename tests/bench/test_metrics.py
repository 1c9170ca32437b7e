"""Metric definitions on synthetic timelines: no model, no clock."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.bench.metrics import (
    RequestRecord,
    add_gains,
    median_point,
    percentile,
    phase_rates,
    summarize,
    tpot,
    ttft,
)


def rec(start: float, times: list[float], inp: int = 10, req_out: int | None = None) -> RequestRecord:
    out = len(times)
    return RequestRecord("r", inp, req_out if req_out is not None else out, inp, out, 0, start,
                         times[0], times[-1], list(times))


def test_ttft_tpot_e2e() -> None:
    r = rec(0.25, [0.75, 1.25, 1.75, 2.25, 2.75])
    assert ttft(r) == pytest.approx(0.5)
    # TPOT = (E2E - TTFT) / (out - 1) = (2.5 - 0.5) / 4
    assert tpot(r) == pytest.approx(0.5)
    assert tpot(rec(0.0, [1.0])) is None  # one token: no gap to average


@pytest.mark.parametrize("q", [0, 10, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [0.3, 1.0, 7.5, 2.0, 2.0, 9.1, 4.4]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 95) == pytest.approx(3.85)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_phase_rates_do_not_count_tokens_made_during_prefill() -> None:
    # A: first token at 1.0, then one per 0.5 s; B's prompt finishes later, at 2.0.
    a = rec(0.0, [1.0, 1.5, 2.0, 2.5, 3.0], inp=100)
    b = rec(0.0, [2.0, 2.5, 3.0], inp=300)
    prefill, decode, end = phase_rates([a, b])
    assert end == 2.0
    assert prefill == pytest.approx(400 / 2.0)
    # Decode window 2.0..3.0: A's 2.5, 3.0 and B's 2.5, 3.0 -> 4 tokens in 1 s.
    assert decode == pytest.approx(4.0)


def test_summarize_and_shape_check() -> None:
    a = rec(0.0, [1.0, 2.0, 3.0, 4.0], inp=10)
    b = rec(0.0, [2.0, 3.0, 4.0], inp=10, req_out=4)  # asked for 4, got 3
    p = summarize(2, [a, b], wall_s=4.0)
    assert p.output_tokens == 7 and p.output_tokens_per_s == pytest.approx(7 / 4)
    assert p.total_tokens_per_s == pytest.approx(27 / 4)
    assert p.requests_per_s == pytest.approx(0.5)
    assert p.ttft_p50 == pytest.approx(1.5) and p.e2e_p50 == pytest.approx(4.0)
    assert p.per_request_output_tokens_per_s == pytest.approx((1.0 + 0.75) / 2)
    assert p.shape_mismatches == 1


def test_failed_requests_are_counted_not_averaged() -> None:
    bad = RequestRecord("x", 10, 4, 0, 0, 0, 0.0, None, None, error="HTTP 500")
    p = summarize(2, [rec(0.0, [1.0, 2.0]), bad], wall_s=2.0)
    assert p.num_failed == 1 and p.output_tokens == 2


def test_median_point_and_gains() -> None:
    runs = [summarize(1, [rec(0.0, [t, 2 * t])], wall_s=2 * t) for t in (1.0, 2.0, 4.0)]
    m = median_point(runs)
    assert m.wall_s == 4.0 and m.output_tokens_per_s == pytest.approx(2 / 4)
    big = summarize(8, [rec(0.0, [1.0, 2.0])] * 8, wall_s=2.0)
    add_gains([m, big])
    assert big.gain == pytest.approx(8.0 / 0.5 - 1)


# A child that spins for one CPU second, then prints the CPU time it used (start-up included).
SPINNER = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"
           "print(time.process_time(), flush=True)\n")
# Accounting granularity: /proc/stat and /proc/PID/stat count in clock ticks, process_time does not.
TICKS_SLACK_S = 0.2


def assert_child_not_counted_as_other(other: float | None, busy_s: float, child_cpu_s: float) -> None:
    """Other processes may use any CPU meanwhile, so the meter's figure cannot be bounded from below;
    but the machine was busy for `busy_s` over a window around the meter's, and `child_cpu_s` of that
    was the child's: a meter that counts the child as its own reports at most the rest. One that
    counted it as another process's would report about `child_cpu_s` more."""
    assert other is not None
    assert other <= busy_s - child_cpu_s + TICKS_SLACK_S, (
        f"other CPU {other:.2f} s of {busy_s:.2f} s busy: the child's {child_cpu_s:.2f} s counted as another's")


def test_cpu_meter_counts_this_process_children_as_its_own() -> None:
    """vLLM computes in a child process: its CPU time is the benchmark's, not another process's
    (which would flag every vLLM run as measured on a busy machine)."""
    import subprocess
    import sys

    from tokenmill.bench.runner import CpuMeter, _busy_seconds

    busy0 = _busy_seconds()
    assert busy0 is not None, "no /proc/stat here"
    meter = CpuMeter()
    # The child stays alive, reading its stdin, until this test has read the meter.
    child = subprocess.Popen([sys.executable, "-c", SPINNER + "import sys\nsys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_cpu = float(child.stdout.readline())  # type: ignore[union-attr]
        other = meter.other_seconds()
        busy = _busy_seconds()
        assert child.poll() is None, "the child exited before the meter read it"
    finally:
        child.communicate()  # closes its stdin: it exits
    assert busy is not None
    assert_child_not_counted_as_other(other, busy - busy0, child_cpu)


def test_cpu_meter_counts_a_finished_child_as_its_own() -> None:
    """A tool benchmarked as a subprocess (llama-bench) has exited by the time the meter reads:
    its CPU time is still the benchmark's."""
    import subprocess
    import sys

    from tokenmill.bench.runner import CpuMeter, _busy_seconds

    busy0 = _busy_seconds()
    assert busy0 is not None, "no /proc/stat here"
    meter = CpuMeter()
    done = subprocess.run([sys.executable, "-c", SPINNER], capture_output=True, text=True, check=True)
    other = meter.other_seconds()
    busy = _busy_seconds()
    assert busy is not None
    assert_child_not_counted_as_other(other, busy - busy0, float(done.stdout))
