"""Prometheus metrics: histograms and token counters fed by the engine thread, scheduler gauges
read from its latest snapshot. One registry per server, so several can live in one process.

Every series is recorded once, under its `tokenmill_*` name; at scrape time the series that mean
what one of vLLM's does are also written under vLLM's name, with vLLM's `model_name` label, so
dashboards built for vLLM work unchanged and the two names can never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenmill.engine import SchedulerMetrics

if TYPE_CHECKING:
    from tokenmill.embed.inputs import EmbedderStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)

# tokenmill family → vLLM's names for it (vLLM v1, docs.vllm.ai "Production Metrics"). Family
# names, as prometheus-client keeps them: a counter's samples add `_total`, a histogram's `_bucket`…
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "tokenmill_num_requests_running": ("vllm:num_requests_running",),
    "tokenmill_num_requests_waiting": ("vllm:num_requests_waiting",),
    "tokenmill_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc",),  # a 0..1 fraction under both names
    "tokenmill_prompt_tokens": ("vllm:prompt_tokens",),
    "tokenmill_generation_tokens": ("vllm:generation_tokens",),
    "tokenmill_requests_finished": ("vllm:request_success",),
    "tokenmill_num_preemptions": ("vllm:num_preemptions",),
    "tokenmill_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "tokenmill_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "tokenmill_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM renamed time_per_output_token to inter_token_latency; dashboards use either.
    "tokenmill_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                              "vllm:time_per_output_token_seconds"),
    "tokenmill_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "tokenmill_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "tokenmill_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "tokenmill_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
VLLM_LABELS = {"finish_reason": "finished_reason"}  # vLLM's spelling of a label we share


class ServeMetrics:
    def __init__(self, snapshot: Callable[[], SchedulerMetrics | None], model_name: str,
                 embedding_stats: Callable[[], EmbedderStats | None] = lambda: None) -> None:
        """`snapshot`: the engine thread's latest scheduler state; `embedding_stats`: an embedding
        model's running totals (live requests and Batch API lines alike)."""
        own = CollectorRegistry()  # the tokenmill_* series; `registry` serves them under both names
        self.time_to_first_token = Histogram(
            "tokenmill_time_to_first_token_seconds", "arrival to first generated token", buckets=LATENCY_BUCKETS,
            registry=own)
        self.inter_token_latency = Histogram(
            "tokenmill_inter_token_latency_seconds", "time between consecutive tokens of a request",
            buckets=TOKEN_BUCKETS, registry=own)
        self.e2e_latency = Histogram(
            "tokenmill_e2e_request_latency_seconds", "arrival to finish", buckets=LATENCY_BUCKETS, registry=own)
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "prompt tokens of finished requests", registry=own)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "tokens generated", registry=own)
        self.requests_finished = Counter(
            "tokenmill_requests_finished", "finished requests by finish reason", ["finish_reason"], registry=own)
        for reason in ("stop", "length", "abort"):  # exported as 0 before the first one happens
            self.requests_finished.labels(finish_reason=reason)
        own.register(_SchedulerCollector(snapshot))
        own.register(_EmbeddingCollector(embedding_stats))
        self.registry = CollectorRegistry()
        self.registry.register(_WithVllmNames(own, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def embedding_request_finished(self, prompt_tokens: int, seconds: float) -> None:
        """A live /v1/embeddings request answered: counted as vLLM counts a pooling request."""
        self.prompt_tokens.inc(prompt_tokens)
        self.requests_finished.labels(finish_reason="stop").inc()
        self.e2e_latency.observe(seconds)


class _WithVllmNames:
    """Every family of `source`, then the same samples again under each of its vLLM names."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self._source, self._model_name = source, model_name

    def collect(self) -> Iterator[Metric]:
        families = list(self._source.collect())  # one read: both names show the same values
        yield from families
        for family in families:
            for name in VLLM_NAMES.get(family.name, ()):
                yield _renamed(family, name, self._model_name)


def _renamed(family: Metric, name: str, model_name: str) -> Metric:
    renamed = Metric(name, family.documentation, family.type, family.unit)
    for sample in family.samples:
        labels = {"model_name": model_name, **{VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}}
        suffix = sample.name[len(family.name):]  # _total, _bucket, _sum, _count, _created, or nothing
        renamed.samples.append(sample._replace(name=name + suffix, labels=labels))
    return renamed


# The scheduler's counters on /metrics: (metric, help, SchedulerStats field).
SCHEDULER_COUNTERS = (
    ("tokenmill_prefix_cache_queries", "prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("tokenmill_prefix_cache_hits", "prompt tokens served from the prefix cache", "prefix_cache_hits"),
    ("tokenmill_num_preemptions", "requests preempted", "num_preemptions"),
    ("tokenmill_prefill_tokens", "tokens computed from known tokens", "prefill_tokens"),
    ("tokenmill_decode_tokens", "tokens computed by decode steps", "decode_tokens"),
    ("tokenmill_spec_decode_num_drafts", "drafts verified (a sequence's drafts in a step)", "num_drafts"),
    ("tokenmill_spec_decode_num_draft_tokens", "draft tokens verified", "num_draft_tokens"),
    ("tokenmill_spec_decode_num_accepted_tokens", "draft tokens the model accepted", "num_accepted_tokens"),
)


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
        for name, documentation, field_name in SCHEDULER_COUNTERS:
            yield CounterMetricFamily(name, documentation, value=getattr(snap.stats, field_name))


class _EmbeddingCollector:
    """An embedding model's totals at scrape time: inputs embedded, their tokens, forward seconds."""

    def __init__(self, stats: Callable[[], EmbedderStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:
            return
        yield CounterMetricFamily("tokenmill_embedding_inputs", "inputs embedded (one vector each)", value=stats.inputs)
        yield CounterMetricFamily("tokenmill_embedding_tokens", "tokens of the inputs embedded", value=stats.tokens)
        yield CounterMetricFamily("tokenmill_embedding_forward_seconds", "seconds in the embedding model's forwards",
                                  value=stats.seconds)
