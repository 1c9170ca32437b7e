"""A job from start to end: validate, claim the output, skip what is done, run the rest on a
backend, write the summary, return the outcome.

Backends (embedded engine, HTTP endpoint; the contract is in backend.py, the specs that build
them in backend_specs.py) only turn requests into response bodies and hand them to the
`ResultSink`; everything about files, resuming and counting lives here and in output.py. What to
print at the end, and the exit code, are the caller's (jobs/cli.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from tokenmill.jobs import output
from tokenmill.jobs.backend import Backend, BackendStats, ResultSink, StopFlag
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.output import JobError, JsonlAppender, OutputPaths, OutputState, scan_outputs
from tokenmill.jobs.progress import JobProgress
from tokenmill.jobs.spec import Entry, InputFile, read_input
from tokenmill.jobs.summary import JobOutcome, build_summary

MAX_LISTED_ERRORS = 20


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
) -> JobOutcome:
    """Run (or resume) a job and say what it did. Raises JobError when it cannot start, JobFailed
    when it started and could not go on (a re-run resumes).

    `console`: where progress goes (stderr by default; the server passes a quiet one). `stop`: set
    by the caller to stop the job from another thread (the server's Batch API)."""
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
                _say(console, f"starting the {backend.kind} backend ({backend.model}) for {len(todo)} request(s)")
                backend.start()  # backends report their own load time in their stats (an embedded
                # engine may have loaded already, to check the input)
                sink.progress = JobProgress(spec.num_lines, spec.num_lines - len(todo), console, config.progress)
                start = time.monotonic()
                with sink.progress:
                    stats = backend.run(spec.requests(todo), sink, stop)
                wall = time.monotonic() - start
    finally:
        results.close()
        errors.close()
    outcome = build_summary(config, paths, spec, state, sink, stats, wall, backend, interrupted=stop.requested)
    output.write_json_atomic(paths.summary, outcome.to_json())
    return outcome


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
