"""The bill at the end of a job (`JobOutcome`): counts, tokens, speeds and cost, typed, as JSON
(summary.json) and as a table.

Definitions (also in docs/jobs.md):
- output tok/s = completion tokens of this run ÷ wall time of this run (model load excluded);
- prefill tok/s = tokens the engine prefilled ÷ the time of the engine steps that prefilled any;
- decode tok/s = tokens the engine decoded ÷ the time of the engine steps that decoded any
  (a step doing both counts in both, so both rates are lower bounds of the pure speeds);
- cost: $/hour ÷ (output tok/s × 3600) per token; the job's cost = $/hour × wall hours
  (tokenmill/cost.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from tokenmill.cost import millions_per_usd, usd_for, usd_per_million
from tokenmill.engine import SchedulerStats
from tokenmill.jobs.backends.base import Backend, BackendStats, ResultSink
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.state import OutputState
from tokenmill.jobs.work import InputCounts


@dataclass
class RequestCounts:
    """The whole job's rows (total, done, failed, not done) and this run's share of them."""

    total: int
    done: int
    failed: int
    not_done: int
    invalid_lines: int
    retryable: int  # failed for a reason a re-run may fix (rate limits, server errors, timeouts)
    done_this_run: int
    failed_this_run: int
    # Asking for a structured output, and of those, answered but ended by max_tokens (finish_reason
    # "length"): an answer cut short does not follow its schema or grammar.
    structured: int
    structured_cut: int
    # Rows that gave no max_tokens, and the cap they got instead (--max-tokens, or the default).
    max_tokens_defaulted: int
    default_max_tokens: int


@dataclass
class TokenCounts:
    """This run's tokens, as the usage of its responses says."""

    prompt: int
    cached: int
    completion: int
    vectors: int = 0  # embeddings returned (a /v1/embeddings row may ask for several)


@dataclass
class EngineCounts:
    """This run, as the backend measured it: prefill/decode tokens and seconds and preemptions (an
    engine), retries and the rows each endpoint wrote (endpoints), replicas (--ray: engine seconds
    summed over them)."""

    prefill_tokens: int | None
    decode_tokens: int | None
    prefill_s: float | None
    decode_s: float | None
    preemptions: int | None
    retries: int | None
    replicas: int | None
    rows_by_endpoint: dict[str, int] | None
    num_drafts: int | None = None  # speculative decoding: drafts verified, their tokens, tokens accepted
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


@dataclass
class Timing:
    load_s: float
    wall_s: float


@dataclass
class Throughput:
    prefill_tok_s: float | None
    decode_tok_s: float | None
    output_tok_s: float | None
    total_tok_s: float | None
    input_tok_s: float | None = None  # prompt tokens ÷ wall: what an embedding job is billed by
    vectors_per_s: float | None = None


@dataclass
class Cost:
    price_per_hour: float
    usd_per_million_output_tokens: float | None
    million_output_tokens_per_usd: float | None
    job_usd: float | None
    usd_per_million_input_tokens: float | None = None


@dataclass
class JobOutcome:
    """What a job did, as `run_job` returns it and summary.json holds it (`to_json`)."""

    input_path: str
    results_path: str
    errors_path: str
    backend: str
    model: str
    interrupted: bool  # stopped (Ctrl-C, SIGTERM, a cancel) with rows not done: a re-run resumes
    requests: RequestCounts
    tokens: TokenCounts
    engine: EngineCounts
    time: Timing
    throughput: Throughput
    cost: Cost | None  # with a price per hour

    @property
    def status(self) -> str:
        """"interrupted", "failed" (some rows have a final error: see errors_path) or "done"."""
        if self.interrupted:
            return "interrupted"
        return "failed" if self.requests.failed else "done"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_summary(
    config: JobConfig,
    paths: OutputPaths,
    counts: InputCounts,
    state: OutputState,
    sink: ResultSink,
    stats: BackendStats,
    wall: float,
    backend: Backend,
    interrupted: bool,
) -> JobOutcome:
    """`counts` covers the lines this run read; `state` the ones earlier runs finished (which this
    run skipped unread)."""
    done = state.done + counts.done_unindexed + sink.done
    failed = counts.invalid + counts.failed_before + sink.failed
    requests = RequestCounts(
        total=counts.records, done=done, failed=failed, not_done=max(0, counts.records - done - failed),
        invalid_lines=counts.invalid, retryable=sink.transient,
        done_this_run=sink.done, failed_this_run=sink.failed, structured=state.structured + counts.structured,
        structured_cut=state.structured_cut + counts.structured_cut_unindexed + sink.structured_cut,
        max_tokens_defaulted=state.max_tokens_defaulted + counts.max_tokens_defaulted,
        default_max_tokens=config.options.default_max_tokens,
    )
    engine = EngineCounts(
        prefill_tokens=stats.prefill_tokens, decode_tokens=stats.decode_tokens,
        prefill_s=_round(stats.prefill_s), decode_s=_round(stats.decode_s),
        preemptions=stats.num_preemptions, retries=stats.retries, replicas=stats.replicas,
        rows_by_endpoint=stats.rows_by_endpoint, num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens, num_accepted_tokens=stats.num_accepted_tokens,
    )
    output_rate = _rate(sink.completion_tokens, wall)
    throughput = Throughput(
        prefill_tok_s=_rate(stats.prefill_tokens, stats.prefill_s),
        decode_tok_s=_rate(stats.decode_tokens, stats.decode_s),
        output_tok_s=output_rate,
        total_tok_s=_rate(sink.prompt_tokens + sink.completion_tokens, wall),
        input_tok_s=_rate(sink.prompt_tokens, wall), vectors_per_s=_rate(sink.vectors, wall) if sink.vectors else None,
    )
    return JobOutcome(
        input_path=str(config.input), results_path=str(paths.results), errors_path=str(paths.errors),
        backend=backend.kind, model=backend.model,
        interrupted=interrupted and requests.not_done > 0,  # a signal after the last row stopped nothing
        requests=requests,
        tokens=TokenCounts(sink.prompt_tokens, sink.cached_tokens, sink.completion_tokens, sink.vectors),
        engine=engine, time=Timing(round(stats.load_s, 3), round(wall, 3)),
        throughput=throughput, cost=_cost(config.price_per_hour, throughput, wall),
    )


def _cost(price_per_hour: float | None, throughput: Throughput, wall: float) -> Cost | None:
    if price_per_hour is None:
        return None
    rate = throughput.output_tok_s or 0.0
    return Cost(
        price_per_hour=price_per_hour,
        usd_per_million_output_tokens=_significant(usd_per_million(price_per_hour, rate)),
        million_output_tokens_per_usd=_significant(millions_per_usd(price_per_hour, rate)),
        job_usd=_significant(usd_for(price_per_hour, wall)),
        usd_per_million_input_tokens=_significant(usd_per_million(price_per_hour, throughput.input_tok_s or 0.0)),
    )


def _rate(tokens: int | None, seconds: float | None) -> float | None:
    if tokens is None or not seconds:
        return None
    return round(tokens / seconds, 2)


def _significant(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else float(f"{value:.{digits}g}")


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def print_summary(outcome: JobOutcome, console: Console) -> None:
    req, tok, eng, thr = outcome.requests, outcome.tokens, outcome.engine, outcome.throughput
    table = Table(title=f"tokenmill run · {outcome.backend} · {outcome.model}", show_header=False,
                  title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    this_run = f" (this run: {req.done_this_run} done, {req.failed_this_run} failed)"
    table.add_row("requests", f"{req.done} done · {req.failed} failed · {req.not_done} not done "
                  f"of {req.total}" + (this_run if req.done_this_run != req.done else ""))
    if req.max_tokens_defaulted:
        table.add_row("max_tokens", f"{req.max_tokens_defaulted:,} row(s) had no max_tokens: capped at "
                      f"{req.default_max_tokens} (--max-tokens)")
    if req.structured:
        table.add_row("structured", f"{req.structured} request(s) · {req.structured_cut} cut by max_tokens "
                      '(finish_reason "length": incomplete)')
    embeddings = tok.vectors > 0 and tok.completion == 0  # nothing generated: billed by the tokens read
    if embeddings:
        table.add_row("tokens", f"input {tok.prompt:,} · {tok.vectors:,} vector(s)")
    else:
        table.add_row("tokens", f"prompt {tok.prompt:,} (cached {tok.cached:,}) · completion {tok.completion:,}")
    table.add_row("time", f"wall {outcome.time.wall_s:.1f} s · model load {outcome.time.load_s:.1f} s")
    if embeddings:
        forwards = "" if thr.prefill_tok_s is None else f" (in forwards: {_fmt(thr.prefill_tok_s)} tok/s)"
        table.add_row("embedding", f"{_fmt(thr.vectors_per_s)} vectors/s · {_fmt(thr.input_tok_s)} input tok/s"
                      + forwards)
    elif eng.prefill_tokens is not None:
        table.add_row("prefill", _speed(eng.prefill_tokens, eng.prefill_s, thr.prefill_tok_s))
        table.add_row("decode", _speed(eng.decode_tokens, eng.decode_s, thr.decode_tok_s))
    if eng.num_draft_tokens:
        table.add_row("speculative", _speculation(eng))
    if eng.retries is not None:
        table.add_row("retries", f"{eng.retries}")
    if eng.rows_by_endpoint and len(eng.rows_by_endpoint) > 1:
        table.add_row("endpoints", " · ".join(f"{rows:,} rows at {url}" for url, rows in eng.rows_by_endpoint.items()))
    if eng.replicas is not None:
        per = " (prefill / decode rates are per replica)" if eng.prefill_tokens is not None else ""
        table.add_row("replicas", f"{eng.replicas} on Ray{per}; output and cost are the whole job's")
    if not embeddings:
        table.add_row("output", f"{_fmt(thr.output_tok_s)} tok/s · total {_fmt(thr.total_tok_s)} tok/s")
    if outcome.cost is not None and embeddings:
        c = outcome.cost
        table.add_row(f"cost at ${c.price_per_hour:g}/h", f"${_fmt(c.usd_per_million_input_tokens, 4)} per M input "
                      f"tokens · this run ${c.job_usd:.2g}")
    elif outcome.cost is not None:
        c = outcome.cost
        table.add_row(
            f"cost at ${c.price_per_hour:g}/h",
            f"${_fmt(c.usd_per_million_output_tokens, 2)} per M output tokens · "
            f"{_fmt(c.million_output_tokens_per_usd, 2)} M output tokens per $ · this run ${c.job_usd:.2g}",
        )
    table.add_row("files", f"{outcome.results_path} · {outcome.errors_path}")
    console.print(table)


def _speculation(eng: EngineCounts) -> str:
    accepted, drafted, drafts = eng.num_accepted_tokens or 0, eng.num_draft_tokens or 0, eng.num_drafts or 1
    stats = SchedulerStats(num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted)
    return (f"{accepted:,} of {drafted:,} draft tokens accepted ({stats.draft_acceptance_rate:.0%}) · "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}")


def _speed(tokens: int | None, seconds: float | None, rate: float | None) -> str:
    return f"{tokens or 0:,} tok in {seconds or 0:.1f} s → {_fmt(rate)} tok/s"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"
