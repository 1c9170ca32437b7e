"""Timing helpers shared by the kernel benchmarks in this folder."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from tokenmill.engine import LLMEngine


def median_ms(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median wall time of fn in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def step_ms(engines: dict[str, LLMEngine], rounds: int = 5, steps: int = 8) -> dict[str, float]:
    """Median ms per engine step of each engine, taking turns so that drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
