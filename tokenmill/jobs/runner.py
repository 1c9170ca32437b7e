"""A job from start to end: validate, claim the output, skip what is done, run the rest on a
backend, write the summary.

Backends (embedded engine, HTTP endpoint) only turn requests into response bodies and hand them
to the `ResultSink`; everything about files, resuming and counting lives here and in output.py.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tokenmill.jobs import output
from tokenmill.jobs.output import JobError, JsonlAppender, OutputPaths, RowWriter
from tokenmill.jobs.progress import JobProgress
from tokenmill.jobs.spec import BatchRequest, DocumentOptions, Entry, InputFile, read_input
from tokenmill.jobs.summary import Summary, build_summary, print_summary

ORDERS = ("input", "length-buckets")
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
MAX_LISTED_ERRORS = 20


@dataclass
class JobConfig:
    input: Path
    output: Path
    options: DocumentOptions = field(default_factory=DocumentOptions)
    errors: Path | None = None
    input_format: str = "auto"
    strict: bool = False
    overwrite: bool = False
    order: str = "input"
    price_per_hour: float | None = None
    progress: bool = True
    fsync_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"--order must be one of {ORDERS}, got {self.order!r}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {self.price_per_hour}")


@dataclass
class BackendStats:
    """What a backend measured while running. Engine numbers are None for an endpoint."""

    load_s: float = 0.0
    prefill_tokens: int | None = None  # tokens computed from known tokens (prompt, recompute)
    decode_tokens: int | None = None  # tokens computed from the previous step's sample
    prefill_s: float | None = None  # time of engine steps that computed any prefill token
    decode_s: float | None = None  # time of engine steps that computed any decode token
    num_preemptions: int | None = None
    retries: int | None = None  # endpoint: attempts beyond the first
    replicas: int | None = None  # --ray: engines (or endpoint clients) the work was spread over


class Backend(Protocol):
    kind: str  # "embedded" | "endpoint"
    model: str  # what the results are generated with (part of the job's fingerprint)

    def check(self, request: BatchRequest) -> None:
        """Raise ValueError naming the problem if this backend cannot serve the request."""

    def start(self) -> None:
        """Load the model / open connections; called only when there is work."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        """Serve `requests`, handing each outcome to `sink`, until done or `stop` says so."""


class StopFlag:
    """Set by the first Ctrl-C / SIGTERM (stop admitting work) and the second (abort in-flight)."""

    def __init__(self) -> None:
        self.requested = False
        self.forced = False

    def request(self) -> None:
        self.forced = self.requested
        self.requested = True


@contextmanager
def stop_on_signals(stop: StopFlag) -> Iterator[None]:
    """SIGINT and SIGTERM set `stop` instead of raising, so the loop can stop between steps."""
    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.signal(s, lambda *_: stop.request()) for s in signals}
    except ValueError:  # not the main thread: no handlers, the caller stops us some other way
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class ResultSink:
    """Where backends hand every outcome: one row written (and flushed) per request."""

    def __init__(self, results: RowWriter, errors: RowWriter, progress: JobProgress | None) -> None:
        self._results, self._errors, self.progress = results, errors, progress
        self.done = self.failed = self.transient = 0
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0

    def result(self, request: BatchRequest, body: dict[str, Any], request_id: str | None = None) -> None:
        self._results.write(output.result_row(request.custom_id, body, request_id))
        self._count_result(body)

    def error(
        self, request: BatchRequest, code: str, message: str, response: dict[str, Any] | None = None
    ) -> None:
        self._errors.write(output.error_row(request.custom_id, request.line, code, message, response))
        self._count_error(code)

    def row(self, row: dict[str, Any]) -> None:
        """A row already made by `result` / `error` elsewhere (on a Ray replica)."""
        if row.get("error") is None:
            self._results.write(row)
            self._count_result(row["response"]["body"])
        else:
            self._errors.write(row)
            self._count_error(row["error"]["code"])

    def _count_result(self, body: dict[str, Any]) -> None:
        prompt, cached, completion = output.usage_of(body)
        self.done += 1
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        if self.progress:
            self.progress.advance(completion)

    def _count_error(self, code: str) -> None:
        self.failed += 1
        self.transient += code in output.TRANSIENT_CODES
        if self.progress:
            self.progress.advance()


@dataclass
class OutputState:
    """What earlier runs of this job left in the output files."""

    done: set[str] = field(default_factory=set)  # custom_ids with a result
    failed: set[str] = field(default_factory=set)  # custom_ids with a final error
    invalid_lines: set[int] = field(default_factory=set)  # bad input lines already recorded
    repaired_bytes: int = 0  # torn tail cut off the files
    retrying: int = 0  # transient errors dropped from the errors file, to be tried again


def scan_outputs(paths: OutputPaths) -> OutputState:
    """Repair torn tails, collect what is finished, drop transient errors so they are retried."""
    state = OutputState()
    results, cut = output.repair_jsonl(paths.results)
    state.repaired_bytes += cut
    state.done = {r["custom_id"] for r in results if isinstance(r.get("custom_id"), str)}
    errors, cut = output.repair_jsonl(paths.errors)
    state.repaired_bytes += cut
    final = [r for r in errors if output.is_final(r)]
    if len(final) < len(errors):
        state.retrying = len(errors) - len(final)
        output.rewrite_jsonl(paths.errors, final)
    for row in final:
        if (row.get("error") or {}).get("code") == output.INVALID_INPUT:
            state.invalid_lines.add(row.get("line"))
        elif isinstance(row.get("custom_id"), str) and row["custom_id"] not in state.done:
            state.failed.add(row["custom_id"])
    return state


def order_entries(entries: list[Entry], order: str) -> list[Entry]:
    """`length-buckets`: biggest first, in power-of-two size buckets, input order within a bucket.

    Long requests started last become the tail that keeps the job running at batch 1; starting
    them first lets the short ones fill in around them.
    """
    if order == "input":
        return entries
    return sorted(entries, key=lambda e: (-e.cost.bit_length(), e.line))


def run_job(
    config: JobConfig, backend: Backend, console: Console | None = None, stop: StopFlag | None = None
) -> int:
    """Run (or resume) a job; returns the exit code. Raises JobError when it cannot start.

    `stop`: set by the caller to stop the job from another thread (the server's Batch API).
    """
    console = console or Console(stderr=True)
    paths = OutputPaths.from_option(config.output, config.errors)
    spec = read_input(config.input, config.options, config.input_format, backend.check)
    _check_input(spec, config)
    settings = {"format": spec.format, "backend": backend.kind, "model": backend.model,
                **config.options.fingerprint()}
    resumed = output.claim_outputs(paths, output.job_record(config.input, spec.sha256, settings), config.overwrite)
    state = scan_outputs(paths)
    finished = state.done | state.failed
    todo = order_entries([e for e in spec.entries if e.custom_id not in finished], config.order)
    _announce(console, spec, paths, state, resumed, len(todo))

    results = JsonlAppender(paths.results, config.fsync_interval)
    errors = JsonlAppender(paths.errors, config.fsync_interval)
    stop = stop or StopFlag()
    stats, wall = BackendStats(), 0.0
    try:
        for error in spec.errors:
            if error.line not in state.invalid_lines:
                errors.write(output.input_error_row(error))
        sink = ResultSink(results, errors, None)
        if todo:
            with stop_on_signals(stop):
                load_start = time.monotonic()
                _say(console, f"starting the {backend.kind} backend ({backend.model}) for {len(todo)} request(s)")
                backend.start()
                load_s = time.monotonic() - load_start
                sink.progress = JobProgress(spec.num_lines, spec.num_lines - len(todo), console, config.progress)
                start = time.monotonic()
                with sink.progress:
                    stats = backend.run(spec.requests(todo), sink, stop)
                wall = time.monotonic() - start
                stats.load_s += load_s  # a Ray backend reports its replicas' loads, inside `wall`
    finally:
        results.close()
        errors.close()
    summary = build_summary(config, paths, spec, state, sink, stats, wall, backend, interrupted=stop.requested)
    output.write_json_atomic(paths.summary, summary.to_json())
    print_summary(summary, Console())
    return _finish_message(console, summary)


def _check_input(spec: InputFile, config: JobConfig) -> None:
    if spec.num_lines == 0:
        raise JobError(f"{config.input}: no requests (the file is empty)")
    if spec.errors and config.strict:
        listed = "\n".join(f"  {e.message}" for e in spec.errors[:MAX_LISTED_ERRORS])
        more = len(spec.errors) - MAX_LISTED_ERRORS
        raise JobError(
            f"{config.input}: {len(spec.errors)} bad line(s), nothing was run (--strict):\n{listed}"
            + (f"\n  … and {more} more" if more > 0 else "")
        )


def _announce(
    console: Console, spec: InputFile, paths: OutputPaths, state: OutputState, resumed: bool, todo: int
) -> None:
    if spec.errors:
        _say(console, f"{len(spec.errors)} bad line(s) → {paths.errors}:")
        for error in spec.errors[:MAX_LISTED_ERRORS]:
            _say(console, f"  {error.message}")
        if len(spec.errors) > MAX_LISTED_ERRORS:
            _say(console, f"  … and {len(spec.errors) - MAX_LISTED_ERRORS} more")
    if state.repaired_bytes:
        _say(console, f"repaired a torn last line ({state.repaired_bytes} bytes cut) in the output")
    if resumed:
        _say(console, f"resuming: {len(state.done)} done, {len(state.failed)} failed for good, "
                      f"{state.retrying} transient failure(s) to retry; {todo} request(s) to run")
    if not todo:
        _say(console, "nothing to run: every request already has a result or a final error")


def _say(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _finish_message(console: Console, summary: Summary) -> int:
    req = summary.requests
    if summary.interrupted:
        _say(console, f"interrupted: {req['not_done']} request(s) not done. Re-run the same command to resume; "
                      f"the {req['done']} result(s) so far are kept in {summary.results_path}")
        return EXIT_INTERRUPTED
    if req["retryable"]:
        _say(console, f"{req['retryable']} request(s) failed after retries (rate limits, server errors, "
                      "timeouts); re-run the same command to try them again")
    if req["failed"]:
        _say(console, f"{req['failed']} request(s) failed: see {summary.errors_path}")
        return EXIT_FAILED
    return EXIT_OK
