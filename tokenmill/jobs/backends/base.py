"""The contract between a job and whatever serves its requests.

A `Backend` (the embedded engine, an HTTP endpoint, Ray replicas of either, the server's engine
loop for the Batch API) turns requests into response bodies and hands every outcome to the
`ResultSink`; the job runner (runner.py) owns the files, resuming and counting. To add a
backend: implement `Backend` (and `Abortable` / `SharesMachine` / `HoldsModel` where they apply),
then choose it in cli.py.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.input.seen_ids import id_key
from tokenmill.jobs.journal.index import IndexEntry, index_flags
from tokenmill.jobs.journal.rows import error_row, finish_reason_of, is_transient, result_row, usage_of, vectors_of
from tokenmill.jobs.journal.writers import RowWriter


@dataclass
class BackendStats:
    """What a backend measured while running. Engine numbers are None for an endpoint."""

    load_s: float = 0.0  # loading the model / connecting, as the backend measured it
    prefill_tokens: int | None = None  # tokens computed from known tokens (prompt, recompute)
    decode_tokens: int | None = None  # tokens computed from the previous step's sample
    prefill_s: float | None = None  # time of engine steps that computed any prefill token
    decode_s: float | None = None  # time of engine steps that computed any decode token
    num_preemptions: int | None = None
    # Speculative decoding (the engine's counters, engine/interface.py SchedulerStats): drafts
    # verified, their tokens, and the tokens the model accepted.
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    retries: int | None = None  # endpoint: attempts beyond the first
    replicas: int | None = None  # --ray: engines (or endpoint clients) the work was spread over
    rows_by_endpoint: dict[str, int] | None = None  # endpoint: rows (results and final errors) each one wrote

    def add(self, part: BackendStats) -> None:
        """Add one batch's stats into the job's: counts and engine seconds summed, load the longest."""
        for f in fields(BackendStats):
            if f.name == "replicas":
                continue
            mine, theirs = getattr(self, f.name), getattr(part, f.name)
            if f.name == "load_s":
                self.load_s = max(mine, theirs)  # replicas load side by side
            elif isinstance(theirs, dict):
                setattr(self, f.name, {key: (mine or {}).get(key, 0) + theirs.get(key, 0)
                                       for key in {**(mine or {}), **theirs}})
            elif theirs is not None:
                setattr(self, f.name, (mine or 0) + theirs)


class BackendUnavailable(RuntimeError):
    """The backend cannot start at all (its model does not load, vLLM is not installed): not any
    one request's fault, so no line is blamed for it."""


class StopFlag:
    """Set by the first Ctrl-C / SIGTERM (stop admitting work) and the second (abort in-flight)."""

    def __init__(self) -> None:
        self.requested = False
        self.forced = False

    def request(self) -> None:
        self.forced = self.requested
        self.requested = True


class Progress(Protocol):
    """What is told of each finished request (the job's progress bar)."""

    def advance(self, completion_tokens: int = 0, prompt_tokens: int = 0) -> None: ...


class ResultSink:
    """Where backends hand every outcome: one row written (and flushed) per request."""

    def __init__(self, results: RowWriter, errors: RowWriter, progress: Progress | None) -> None:
        self._results, self._errors, self.progress = results, errors, progress
        self.done = self.failed = self.transient = 0
        self.structured_cut = 0  # results asking for a structured output that max_tokens ended: not valid
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.vectors = 0  # embeddings in the results (a /v1/embeddings response's data)

    def result(self, request: BatchRequest, body: dict[str, Any], request_id: str | None = None) -> None:
        row = result_row(request.custom_id, body, request_id, request.metadata)
        self._results.write(row, index_entry(request, body))
        self._count_result(body, request.structured)

    def error(
        self, request: BatchRequest, code: str, message: str, response: dict[str, Any] | None = None
    ) -> None:
        self._errors.write(error_row(request.custom_id, request.line, code, message, response, request.metadata))
        self._count_error(code)

    def row(self, row: dict[str, Any], owner: RowOwner) -> None:
        """A row already made by `result` / `error` elsewhere (on a Ray replica), for `owner`'s request."""
        if row.get("error") is None:
            body = row["response"]["body"]
            self._results.write(row, index_entry(owner, body))
            self._count_result(body, owner.structured)
        else:
            self._errors.write(row)
            self._count_error(row["error"]["code"])

    def _count_result(self, body: dict[str, Any], structured: bool) -> None:
        prompt, cached, completion = usage_of(body)
        self.done += 1
        self.structured_cut += structured and finish_reason_of(body) == "length"
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        self.vectors += vectors_of(body)
        if self.progress:
            self.progress.advance(completion, prompt)

    def _count_error(self, code: str) -> None:
        self.failed += 1
        self.transient += is_transient(code)
        if self.progress:
            self.progress.advance()


@dataclass(frozen=True, slots=True)
class RowOwner:
    """What a row is written for, less the request's body: its line, id and what the summary
    counts. A backend that hands its requests elsewhere (Ray) keeps this for each, not the request."""

    line: int
    custom_id: str
    structured: bool
    max_tokens_defaulted: bool

    @classmethod
    def of(cls, request: BatchRequest) -> RowOwner:
        return cls(request.line, request.custom_id, request.structured, request.max_tokens_defaulted)


def index_entry(request: BatchRequest | RowOwner, body: dict[str, Any]) -> IndexEntry:
    flags = index_flags(request.structured, request.max_tokens_defaulted, body)
    return IndexEntry(request.line, id_key(request.custom_id), flags)


class Backend(Protocol):
    kind: str  # "embedded" | "vllm" | "endpoint" | "serve"
    model: str  # what the results are generated with (part of the job's fingerprint)

    def check(self, request: BatchRequest) -> None:
        """Raise ValueError naming the problem if this backend cannot serve the request."""

    def start(self) -> None:
        """Load the model / open connections; called only when there is work."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        """Serve `requests`, handing each outcome to `sink`, until done or `stop` says so."""


@runtime_checkable
class Abortable(Protocol):
    """A backend that keeps requests inside after `run` raised, and can drop them."""

    def abort(self, request_ids: Iterable[str]) -> None: ...


@runtime_checkable
class SharesMachine(Protocol):
    """A backend that sizes itself from the machine, and can be told it gets only part of one."""

    def share_machine(self, share: float) -> None: ...


@runtime_checkable
class LoadsToCheck(Protocol):
    """A backend whose `check` loads its model (to refuse a prompt too long for it up front). A
    driver that only hands requests to replicas (Ray) turns that off: no model where none runs."""

    def check_without_loading(self) -> None: ...


@runtime_checkable
class KeepsState(Protocol):
    """A backend with state of its own that a re-run must find (the Batch API backend's batch
    ids): the runner hands it a path beside the job's output before `start`."""

    def keep_state(self, path: Path) -> None: ...


@runtime_checkable
class HoldsModel(Protocol):
    """A backend that loaded a model of its own (an engine, vLLM's engine processes). Whoever built
    it closes it once its jobs are done (build.py `built_backend`): the model's memory goes before
    the next one loads, and vLLM's processes stop before the interpreter tears down beneath them."""

    def close(self) -> None: ...


def notice(text: str) -> None:
    """A backend's notice to the user, while a job runs (an endpoint down, a batch submitted)."""
    print(f"tokenmill run: {text}", file=sys.stderr)  # above the progress bar (rich redirects stderr)
