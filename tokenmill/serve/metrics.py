"""Prometheus metrics: histograms and token counters fed by the engine thread, scheduler gauges
read from its latest snapshot. One registry per server, so several can live in one process."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.engine import SchedulerMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class ServeMetrics:
    def __init__(self, snapshot: Callable[[], SchedulerMetrics | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "tokenmill_time_to_first_token_seconds", "arrival to first generated token", buckets=LATENCY_BUCKETS,
            registry=r)
        self.inter_token_latency = Histogram(
            "tokenmill_inter_token_latency_seconds", "time between consecutive tokens of a request",
            buckets=TOKEN_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "tokenmill_e2e_request_latency_seconds", "arrival to finish", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "tokens generated", registry=r)
        self.requests_finished = Counter(
            "tokenmill_requests_finished", "finished requests by finish reason", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort"):  # exported as 0 before the first one happens
            self.requests_finished.labels(finish_reason=reason)
        r.register(_SchedulerCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector:
    """Reads the engine thread's last scheduler snapshot at scrape time (never the engine itself)."""

    def __init__(self, snapshot: Callable[[], SchedulerMetrics | None]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        if snap is None:
            return
        yield GaugeMetricFamily("tokenmill_num_requests_running", "requests in the running batch",
                                value=snap.num_running)
        yield GaugeMetricFamily("tokenmill_num_requests_waiting", "requests waiting to be scheduled",
                                value=snap.num_waiting)
        yield GaugeMetricFamily("tokenmill_kv_cache_usage_ratio", "fraction of KV-cache blocks in use",
                                value=snap.kv_usage)
        stats = snap.stats
        yield CounterMetricFamily("tokenmill_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("tokenmill_prefix_cache_hits", "prompt tokens served from the prefix cache",
                                  value=stats.prefix_cache_hits)
        yield CounterMetricFamily("tokenmill_num_preemptions", "requests preempted", value=stats.num_preemptions)
        yield CounterMetricFamily("tokenmill_prefill_tokens", "tokens computed from known tokens",
                                  value=stats.prefill_tokens)
        yield CounterMetricFamily("tokenmill_decode_tokens", "tokens computed by decode steps",
                                  value=stats.decode_tokens)
