"""A job from start to end: claim the output, read the input as the backend asks for work
(skipping what is done), write the summary, return the outcome.

Backends (embedded engine, HTTP endpoint; the contract is in backend.py, the specs that build
them in backend_specs.py) only turn requests into response bodies and hand them to the
`ResultSink`; everything about files, resuming and counting lives here, in output.py (the local
journal) and parts.py (committed parts, for an object store output or parquet). What to print at
the end, and the exit code, are the caller's (jobs/cli.py).
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

from tokenmill.jobs.backends.base import Backend, BackendStats, KeepsState, ResultSink, StopFlag
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.reader import InputStream, count_records, input_identity
from tokenmill.jobs.input.request import Entry
from tokenmill.jobs.journal.guard import OutputLock, refuse_inputs_in
from tokenmill.jobs.journal.identity import job_record
from tokenmill.jobs.journal.parts import JobOutput
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.state import OutputState
from tokenmill.jobs.journal.writers import JsonlAppender
from tokenmill.jobs.progress import JobProgress, say
from tokenmill.jobs.storage import atomic_write_json
from tokenmill.jobs.summary import JobOutcome, build_summary
from tokenmill.jobs.work import JobWork, check_every_line


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
    files = JobOutput(config.layout, say=lambda text: say(console, text))
    refuse_inputs_in(files.footprint(), {"the input": config.input})
    stream = InputStream(config.input, config.options, config.input_format, backend.check)
    if not stream.has_records():
        raise JobError(f"{config.input}: no requests (the file is empty)")
    if config.strict:
        check_every_line(stream)
    with OutputLock(files.paths.lock, config.output):  # before the output is touched
        return _run_locked(config, backend, console, stop, files, stream)


def _run_locked(
    config: JobConfig, backend: Backend, console: Console, stop: StopFlag | None, files: JobOutput,
    stream: InputStream,
) -> JobOutcome:
    paths = files.paths  # the local journal: the output folder, or a URL output's spool
    settings = {"format": stream.format, "backend": backend.kind, "model": backend.model,
                **config.options.fingerprint(), **config.output_fingerprint()}
    job = job_record(config.input, input_identity(config.input), settings)
    resumed = files.claim(job, config.overwrite)
    state = files.scan()
    if isinstance(backend, KeepsState):
        backend.keep_state(paths.backend_state)
    _announce(console, paths, state, resumed)

    results = files.results(config.fsync_interval)  # seals committed parts as it goes, where there are any
    errors = JsonlAppender(paths.errors, config.fsync_interval)
    stop = stop or StopFlag()
    sink = ResultSink(results, errors, None)
    work = JobWork(stream, state, errors, console, advance=lambda: _advance(sink))
    stats, wall = BackendStats(), 0.0
    total: _RecordCount | None = None  # counted only once there is work: a finished job reads no input
    try:
        with stop_on_signals(stop):
            requests = (work.requests() if config.order == "input"
                        else work.ordered(lambda entries: order_entries(entries, config.order)))
            first = next(requests, None)  # none: every line is finished, and no model need load
            if first is not None:
                total = _count_on_the_side(stream)
                say(console, f"starting the {backend.kind} backend ({backend.model})")
                backend.start()  # backends report their own load time in their stats (an embedded
                # engine may have loaded already, to check the input)
                finished = state.done + len(state.unindexed) + state.failed + len(state.invalid_lines)
                sink.progress = JobProgress(total.count, finished, console, config.progress)
                total.on_count = sink.progress.set_total
                if total.count is not None:  # counted before the bar was there to hear it
                    sink.progress.set_total(total.count)
                start = time.monotonic()
                with sink.progress:
                    stats = backend.run(itertools.chain([first], requests), sink, stop)
                wall = time.monotonic() - start
            else:
                say(console, "nothing to run: every request already has a result or a final error")
    finally:
        try:
            results.close()  # with parts: the rows since the last one become one more
        finally:
            errors.close()
            files.publish(paths.errors)
    if not work.counts.read_to_end and total is not None:  # stopped early: the rest is counted, not checked
        total.join()
        work.counts.records = max(stream.records, total.count or 0)
    outcome = build_summary(config, paths, work.counts, state, sink, stats, wall, backend, interrupted=stop.requested)
    outcome.results_path, outcome.errors_path = files.results_location, files.errors_location
    atomic_write_json(paths.summary, outcome.to_json())
    files.publish(paths.summary)
    return outcome


def _advance(sink: ResultSink) -> None:
    if sink.progress is not None:
        sink.progress.advance()


class _RecordCount(threading.Thread):
    """The input's requests, counted on a thread while the job starts: the progress bar's total."""

    def __init__(self, stream: InputStream) -> None:
        super().__init__(name="tokenmill-count", daemon=True)
        self.stream = stream
        self.count: int | None = None
        self.on_count: Callable[[int], None] | None = None

    def run(self) -> None:
        self.count = count_records(self.stream.path, self.stream.format)
        if self.on_count is not None:
            self.on_count(self.count)


def _count_on_the_side(stream: InputStream) -> _RecordCount:
    thread = _RecordCount(stream)
    thread.start()
    return thread


def _announce(console: Console, paths: OutputPaths, state: OutputState, resumed: bool) -> None:
    if state.index_rebuilt:
        say(console, f"{paths.index.name} did not match {paths.results.name} (edited by hand?): read the results "
                     "instead, and began a new index")
    if state.duplicates_dropped:
        say(console, f"removed {state.duplicates_dropped} row(s) from {paths.results.name} whose custom_id an earlier "
                     "row has (two runs wrote it at once?): each line has one result again")
    if state.repaired_bytes:
        say(console, f"repaired a torn last line ({state.repaired_bytes} bytes cut) in the output")
    if resumed:
        say(console, f"resuming: {state.done + len(state.unindexed)} done, {state.failed} failed for good, "
                     f"{state.retrying} transient failure(s) to retry")
