"""Half-price batches: a job submitted through an OpenAI-compatible Batch API (`/v1/files` +
`/v1/batches`): OpenAI's own, which bills a batch at half the price of live requests, or
`tokenmill serve`.

The requests are cut into parts within the API's limits (batch_parts.py). For each part: record
it (its input lines, "uploading") in the state file, upload it, record the file id, create the
batch (its metadata names the job's key and the part's number), record the batch id. Then every
part is polled until its batch is final, its output and error files are downloaded, each row
goes to the sink, and the part is marked merged.

Exactly once, whatever moment a `kill -9` lands:
- a row reaches the job's files only through the sink, and a re-run is given only the requests
  without a row (the runner skips the rest);
- a part is recorded before its upload starts, so a batch can only exist for a recorded part; a
  recorded part without a batch id (killed between creating the batch and recording its id) is
  looked up on the server by its metadata and adopted, else submitted anew;
- a re-run's requests that belong to a recorded, unmerged part are held for that part's batch
  (which is still answering them), never sent again; only the others form new parts;
- a merge hands over only the requests this run was given, so one cut short by a kill is
  finished by the next run, not repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import itertools
import json
import os
import random
import re
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, TypeVar

import aiohttp

from tokenmill.http_client import TRANSPORT_ERRORS, client_session, describe_error
from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag, notice
from tokenmill.jobs.backends.batch_parts import (
    OPENAI_MAX_BYTES,
    OPENAI_MAX_REQUESTS,
    OpenPart,
    PartSplitter,
    batch_line,
    check_limits,
    too_big,
)
from tokenmill.jobs.backends.endpoint import check_server
from tokenmill.jobs.backends.http import (
    RETRY_FOR_S,
    TIMEOUT_S,
    RetryPolicy,
    check_retry_for,
    code_of_status,
    error_message,
)
from tokenmill.jobs.errors import JobError, JobFailed
from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.journal.rows import ErrorCode
from tokenmill.jobs.storage import atomic_write_json
from tokenmill.openai_compat import api_root, is_response_body, response_kind
from tokenmill.settings import SettingError, setting

T = TypeVar("T")

STATE_VERSION = 1
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
UPLOADING, UPLOADED, SUBMITTED, MERGED = "uploading", "uploaded", "submitted", "merged"  # a part's life
LIST_PAGE = 100  # batches per `GET /v1/batches` page (OpenAI's most)
# Batches are listed newest first: paging stops at those created this long before the part was
# recorded (none of them can be its batch; the slack covers a server clock that runs behind ours).
ADOPT_SLACK_S = 3600.0
# What a request that its batch did not answer gets: transient codes, so a re-run tries it again.
UNANSWERED = {"expired": ErrorCode.TIMEOUT, "failed": ErrorCode.SERVER_ERROR, "cancelled": ErrorCode.SERVER_ERROR,
              "completed": ErrorCode.SERVER_ERROR}
# Row codes from the server that mean something else in this job's files.
RENAMED_CODES = {"batch_expired": ErrorCode.TIMEOUT,  # the completion window closed on it: worth another try
                 # the server refused the line: final, like a live 400 (not invalid_input: that is a line
                 # of this job's input that could not be read)
                 "invalid_input": ErrorCode.HTTP_400}
# A server's error message may start with the line in its part: a number that would mislead beside ours.
_PART_LINE = re.compile(r"^line \d+: ")


@dataclass(frozen=True)
class BatchApiSpec:
    """A job sent through `url`'s Batch API. `model`: the name set in every body (None: each
    row's own); the part limits default to OpenAI's."""

    url: str
    model: str | None = None
    api_key: str | None = None
    poll_s: float = setting(30.0, "seconds between status checks of the batches in flight",
                            flag="--poll-interval", metavar="SECONDS")
    completion_window: str = "24h"  # the one OpenAI accepts
    max_requests_per_part: int = setting(OPENAI_MAX_REQUESTS, "requests in one uploaded file "
                                         "(OpenAI's limit by default)", metavar="N")
    max_bytes_per_part: int = setting(OPENAI_MAX_BYTES, "bytes in one uploaded file (OpenAI's "
                                      "limit, 200 MB, by default)", metavar="N")
    timeout_s: float = TIMEOUT_S  # per HTTP attempt
    retry_for_s: float = RETRY_FOR_S  # how long a failing upload / create / poll keeps being retried

    def __post_init__(self) -> None:
        check_server(self.url, self.timeout_s)
        check_retry_for(self.retry_for_s, "retry_for_s")
        if self.poll_s <= 0:
            raise SettingError("{poll_s} must be positive, got {got:g}", got=self.poll_s)
        check_limits(self.max_requests_per_part, self.max_bytes_per_part, "max_requests_per_part",
                     "max_bytes_per_part")


# ---- the state file ------------------------------------------------------------------------------
@dataclass
class PartRecord:
    """One part as the state file keeps it."""

    number: int
    url: str  # the batch's endpoint: every line of a part has this url
    lines: list[int]  # input line numbers (emptied once merged: nothing is held for it any more)
    recorded_at: float  # Unix time; bounds the search for its batch
    status: str = UPLOADING
    file_id: str | None = None
    batch_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "lines": line_ranges(self.lines)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PartRecord:
        lines = [n for start, end in obj["lines"] for n in range(start, end + 1)]
        return cls(**{**obj, "lines": lines})


def line_ranges(lines: list[int]) -> list[list[int]]:
    """[1, 2, 3, 7] → [[1, 3], [7, 7]]: a part's lines are mostly runs, and the file is rewritten often."""
    ranges: list[list[int]] = []
    for n in sorted(set(lines)):
        if ranges and ranges[-1][1] == n - 1:
            ranges[-1][1] = n
        else:
            ranges.append([n, n])
    return ranges


def job_key(path: Path, token: str) -> str:
    """The tag on every batch of one job: its state file's path and a random token, so two jobs
    (two outputs, or one output started over with --overwrite) never adopt each other's batches."""
    return "tm-" + hashlib.sha256(f"{path.resolve()}\0{token}".encode()).hexdigest()[:24]


def part_metadata(key: str, number: int) -> dict[str, str]:
    """The metadata a part's batch is created with, and found by."""
    return {"tokenmill_job": key, "tokenmill_part": str(number)}


@dataclass
class BatchState:
    """The job's parts, kept in a JSON file beside its output and rewritten (atomically) at every
    step of a part, so a re-run knows every batch this job may have created."""

    path: Path
    url: str  # the server the batches were submitted to
    key: str
    parts: dict[int, PartRecord] = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, url: str) -> BatchState:
        """The job's state, created (with a new key) on its first run. JobError when the file is
        unreadable, or names another server while it still has batches there to collect."""
        if not path.exists():
            state = cls(path, url, job_key(path, secrets.token_hex(16)))
            state.save()
            return state
        try:
            doc = json.loads(path.read_text())
            parts = {p["number"]: PartRecord.from_json(p) for p in doc["parts"]}
            state = cls(path, doc["url"], doc["job_key"], parts)
        except (ValueError, KeyError, TypeError) as exc:
            raise JobError(f"{path} is not a Batch API state file ({exc}); use --overwrite to start over") from None
        waiting = [p.number for p in state.unmerged()]
        if state.url != url and waiting:
            raise JobError(f"{path}: part(s) {', '.join(map(str, waiting))} of this job were submitted to "
                           f"{state.url}, not {url}: re-run with --endpoint {state.url} to collect them")
        state.url = url
        return state

    def unmerged(self) -> list[PartRecord]:
        return [p for p in self.parts.values() if p.status != MERGED]

    def next_number(self) -> int:
        return max(self.parts, default=0) + 1

    def record(self, part: PartRecord) -> None:
        self.parts[part.number] = part
        self.save()

    def update(self, part: PartRecord, **changes: Any) -> None:
        for name, value in changes.items():
            setattr(part, name, value)
        if part.status == MERGED:
            part.lines = []
        self.save()

    def save(self) -> None:
        doc = {"version": STATE_VERSION, "url": self.url, "job_key": self.key,
               "parts": [p.to_json() for p in sorted(self.parts.values(), key=lambda p: p.number)]}
        atomic_write_json(self.path, doc)


# ---- the API ----------------------------------------------------------------------------------------
class Stopped(Exception):
    """The job was asked to stop while waiting (Ctrl-C, SIGTERM)."""


class _Transient(Exception):
    """A control call that failed in a way worth another try (429, 5xx, a reply that is not JSON)."""


class BatchApiClient:
    """The Batch API's calls, each retried with backoff on 429s, 5xx, timeouts and lost
    connections for up to `retry_for` seconds (then JobFailed: a re-run resumes); any other 4xx
    is JobFailed at once (a wrong key or URL will not fix itself)."""

    def __init__(self, http: aiohttp.ClientSession, stop: StopFlag, retry_for: float, timeout_s: float) -> None:
        self.http, self.stop, self.timeout_s = http, stop, timeout_s
        self.policy, self._rng = RetryPolicy(retry_for=retry_for), random.Random()
        # A file of 200 MB may take longer than one attempt's limit to move: what is limited is how
        # long the server may stay silent (connecting, taking none of the upload, or once it is sent).
        self._transfer = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)

    async def upload(self, file: IO[bytes], filename: str) -> str:
        async def attempt() -> Any:
            body = _PartReader(file)  # each try sends the whole file, from its start
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", body, filename=filename, content_type="application/jsonl")
            return await _unless_silent(self._post(form, body), body, self.timeout_s)

        return str((await self._retrying(f"uploading {filename}", attempt))["id"])

    async def _post(self, form: aiohttp.FormData, body: _PartReader) -> Any:
        async with self.http.post("v1/files", data=form, timeout=self._transfer) as reply:
            body.answered = True
            return await _json(reply)

    async def create(self, body: dict[str, Any],
                     find: Callable[[], Awaitable[dict[str, Any] | None]]) -> dict[str, Any]:
        """Create a batch. Before a retry, `find` asks whether the failed try created it after all
        (its reply lost): a second one would run the part twice."""
        return await self._retrying("creating a batch", partial(self._call, "POST", "v1/batches", json=body), find)

    async def get(self, batch_id: str) -> dict[str, Any]:
        return await self._retrying(f"checking batch {batch_id}", partial(self._call, "GET", f"v1/batches/{batch_id}"))

    async def find(self, metadata: dict[str, str], since: float) -> dict[str, Any] | None:
        """The newest batch whose metadata holds `metadata`, among those created after `since`."""
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": LIST_PAGE, **({"after": after} if after else {})}
            page = await self._retrying("listing batches", partial(self._call, "GET", "v1/batches", params=params))
            data = page.get("data") or []
            for batch in data:
                if metadata.items() <= (batch.get("metadata") or {}).items():
                    return batch
            if not page.get("has_more") or not data or (data[-1].get("created_at") or 0) < since:
                return None
            after = data[-1]["id"]

    @contextlib.asynccontextmanager
    async def rows(self, file_id: str) -> AsyncIterator[Iterator[dict[str, Any]]]:
        """An output or error file's rows, downloaded whole first (a dropped download is retried
        from the start; the rows it had are not handed over twice) to a file, not to memory."""
        with tempfile.TemporaryFile() as f:
            async def attempt() -> None:
                f.seek(0)
                f.truncate()
                async with self.http.get(f"v1/files/{file_id}/content", timeout=self._transfer) as reply:
                    if reply.status >= 400:
                        await _json(reply)  # raises, naming the failure
                    async for chunk in reply.content.iter_any():
                        f.write(chunk)

            await self._retrying(f"downloading {file_id}", attempt)
            f.seek(0)
            yield (json.loads(line) for line in f if line.strip())

    async def _call(self, method: str, path: str, **options: Any) -> Any:
        async with self.http.request(method, path, **options) as reply:
            return await _json(reply)

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]],
                        find: Callable[[], Awaitable[T | None]] | None = None) -> T:
        started = time.monotonic()
        for tries in itertools.count(1):
            try:
                return await attempt()
            except _Transient as exc:
                problem = str(exc)
            except TRANSPORT_ERRORS as exc:
                problem = describe_error(exc)
            delay = self.policy.backoff(tries, self._rng)
            spent = time.monotonic() - started
            if self.policy.exhausted(tries, spent + delay):
                raise JobFailed(f"{what}: {problem} (gave up after {tries} attempt(s) in {spent:.0f} s, "
                                "--retry-for); every batch submitted is recorded: re-run the same command to resume")
            notice(f"{what}: {problem}; trying again in {delay:.1f} s")
            if await sleep_unless(self.stop, delay):
                raise Stopped
            if find is not None and (found := await find()) is not None:
                return found
        raise AssertionError("unreachable")


class _PartReader(io.RawIOBase):
    """A part's file on disk, read for one upload from its start at a position of its own (a
    retry's reads never race the last try's), noting when each chunk is read: aiohttp reads the
    next one once the last one is sent. Closing it (aiohttp does) leaves the file open."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__()
        file.flush()  # what the part's writer still buffers
        self._fd, self.pos = file.fileno(), 0
        self.size = os.fstat(self._fd).st_size
        self.last_read = time.monotonic()
        self.answered = False  # the reply's headers came

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.pos = max(0, offset + {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence])
        return self.pos

    def readinto(self, buffer: Any) -> int:
        data = os.pread(self._fd, len(buffer), self.pos)
        buffer[:len(data)] = data
        self.pos += len(data)
        self.last_read = time.monotonic()
        return len(data)


async def _unless_silent(upload: Coroutine[Any, Any, T], body: _PartReader, timeout_s: float) -> T:
    """The upload's reply; TimeoutError when, before it comes, the server takes none of the file
    for `timeout_s` (a connection that stalls mid-upload: aiohttp bounds no write) or, once the
    file is read, does not answer within `timeout_s`."""
    task = asyncio.create_task(upload)
    try:
        while not task.done() and not body.answered:
            silent = time.monotonic() - body.last_read
            if silent >= timeout_s:
                raise TimeoutError(f"the server took none of the upload for {timeout_s:g} s" if body.pos < body.size
                                   else f"no reply within {timeout_s:g} s of the upload")
            await asyncio.wait([task], timeout=timeout_s - silent)
        return await task  # its reply's body is bounded by aiohttp's sock_read
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _json(reply: aiohttp.ClientResponse) -> Any:
    """The reply's JSON; _Transient for what a retry may fix, JobFailed for what it will not."""
    raw = await reply.read()
    if reply.status == 429 or reply.status >= 500:
        raise _Transient(f"HTTP {reply.status}: {_error_message(raw)}")
    if reply.status >= 400:
        raise JobFailed(f"{reply.method} {reply.url.path}: HTTP {reply.status}: {_error_message(raw)}")
    try:
        return json.loads(raw)
    except ValueError:
        raise _Transient(f"HTTP {reply.status} with a body that is not JSON") from None


def _error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    return error_message(body, text)


# ---- rows back into the job -----------------------------------------------------------------------
def hand_row(sink: ResultSink, request: BatchRequest, row: dict[str, Any]) -> bool:
    """One row of a batch's output or error file → the sink, coded as the endpoint backend codes a
    live reply. True for a result."""
    response = row.get("response") or {}
    error = row.get("error")
    if error:
        code = str(error.get("code") or ErrorCode.BATCH_ERROR)
        message = _PART_LINE.sub("", str(error.get("message") or ""))
        if code in RENAMED_CODES:
            code, message = RENAMED_CODES[code], f"{code}: {message}"
        sink.error(request, code, message, response or None)
        return False
    status, body = response.get("status_code"), response.get("body")
    if status == 200 and is_response_body(request.url, body):
        sink.result(request, body, response.get("request_id"))
        return True
    if status == 200:
        sink.error(request, ErrorCode.BAD_RESPONSE, f"HTTP 200 without {response_kind(request.url)}", response)
        return False
    message = error_message(body, json.dumps(body))
    sink.error(request, code_of_status(status), f"HTTP {status}: {message}", response)
    return False


async def sleep_unless(stop: StopFlag, seconds: float) -> bool:
    """Sleep, a little at a time; True as soon as a stop is asked for."""
    deadline = time.monotonic() + seconds
    while not stop.requested:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(0.05, left))
    return True


async def _until_stopped(work: Coroutine[Any, Any, None], stop: StopFlag) -> None:
    """Run the job: a stop ends it where it waits (Stopped); a second Ctrl-C also aborts the call in
    flight (a 200 MB upload, a slow reply). Each part's step is in the state file either way, and a
    re-run goes on from there, as after a kill."""
    task = asyncio.create_task(work)
    while not task.done() and not stop.forced:
        await asyncio.wait([task], timeout=0.05)
    task.cancel()
    await asyncio.wait([task])
    if not task.cancelled():
        with contextlib.suppress(Stopped):  # what is submitted stays recorded
            task.result()


# ---- the backend ----------------------------------------------------------------------------------
@dataclass
class _InFlight:
    """A part whose batch is running: the requests it answers for this run, by custom_id."""

    record: PartRecord
    requests: dict[str, BatchRequest]
    status: str = ""  # the batch's status when last polled


class BatchApiBackend:
    kind = "batch-api"

    def __init__(self, spec: BatchApiSpec) -> None:
        self.base_url = api_root(spec.url)
        self.spec = spec
        self.model = spec.model or "as in each request"
        self._state_path: Path | None = None

    def keep_state(self, path: Path) -> None:
        self._state_path = path

    def check(self, request: BatchRequest) -> None:
        """A line over the part byte limit can never be sent: refused with the input's bad lines."""
        if (problem := too_big(batch_line(request), self.spec.max_bytes_per_part, "--max-bytes-per-part")):
            raise ValueError(problem)

    def start(self) -> None:
        """Connections are opened per run."""

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        if self._state_path is None:
            raise RuntimeError("BatchApiBackend needs keep_state(path) before run (run_job calls it): without a "
                               "state file a re-run could not find the batches, and would submit them again")
        state = BatchState.open(self._state_path, self.base_url)
        job = asyncio.run(self._run(state, requests, sink, stop))
        if stop.requested:
            job.say_left_running()
        return BackendStats()

    async def _run(self, state: BatchState, requests: Iterator[BatchRequest], sink: ResultSink,
                   stop: StopFlag) -> _BatchJob:
        spec = self.spec
        # The control calls go one at a time: one connection, kept alive between them.
        async with client_session(self.base_url, aiohttp.ClientTimeout(total=spec.timeout_s), 1, spec.api_key) as http:
            job = _BatchJob(spec, state, BatchApiClient(http, stop, spec.retry_for_s, spec.timeout_s), sink, stop)
            await _until_stopped(job.run(requests), stop)
        return job


class _BatchJob:
    """One run of a Batch API job: take the requests (submitting new parts as they fill), pick up
    the parts earlier runs recorded, then poll until every part is merged."""

    def __init__(self, spec: BatchApiSpec, state: BatchState, api: BatchApiClient, sink: ResultSink,
                 stop: StopFlag) -> None:
        self.spec, self.state, self.api, self.sink, self.stop = spec, state, api, sink, stop
        self.inflight: dict[int, _InFlight] = {}
        recorded = state.unmerged()
        self.held: dict[int, list[BatchRequest]] = {p.number: [] for p in recorded}  # for earlier runs' parts
        self.owner = {line: p.number for p in recorded for line in p.lines}

    async def run(self, requests: Iterator[BatchRequest]) -> None:
        await self._take(requests)
        await self._resume_recorded()
        await self._poll()
        notice(f"every part merged ({len(self.state.parts)} in all)")

    async def _take(self, requests: Iterator[BatchRequest]) -> None:
        full: list[OpenPart] = []  # the splitter hands parts to a plain callback: they are submitted here
        splitter = PartSplitter(self.spec.max_requests_per_part, self.spec.max_bytes_per_part, self._spool,
                                full.append, keep_requests=True)
        try:
            for request in requests:
                if self.stop.requested:
                    raise Stopped
                owner = self.owner.get(request.line)
                if owner is not None:
                    self.held[owner].append(request)  # its batch was submitted by an earlier run
                elif (problem := splitter.add(request)) is not None:
                    self.sink.error(request, ErrorCode.REQUEST_TOO_LARGE, problem)
                await self._submit_full(full)
            splitter.finish()
            await self._submit_full(full)
        finally:
            splitter.drop()
            for part in full:  # full, but a stop came first
                part.file.close()

    async def _submit_full(self, parts: list[OpenPart]) -> None:
        while parts:
            await self._submit_new(parts.pop(0))

    def _spool(self, url: str) -> IO[bytes]:
        """Where a part is written until uploaded: on disk beside the output, not in memory (200 MB)."""
        return tempfile.TemporaryFile(dir=self.state.path.parent, prefix=".batch-part-")

    async def _submit_new(self, part: OpenPart) -> None:
        with part.file:
            if self.stop.requested:
                raise Stopped  # not recorded: its requests are simply not done
            record = PartRecord(self.state.next_number(), part.url, part.lines, time.time())
            self.state.record(record)  # before the upload: from here on a re-run looks for its batch
            await self._submit(record, part.file, part.bytes)
        self.inflight[record.number] = _InFlight(record, {r.custom_id: r for r in part.requests})

    async def _submit(self, record: PartRecord, file: IO[bytes], size: int) -> None:
        name = f"{self.state.key}-part-{record.number:05d}.jsonl"  # names an orphaned upload's job and part
        self.state.update(record, file_id=await self.api.upload(file, name), status=UPLOADED)
        body = {"input_file_id": record.file_id, "endpoint": record.url,
                "completion_window": self.spec.completion_window,
                "metadata": part_metadata(self.state.key, record.number)}
        batch = await self.api.create(body, partial(self._find, record))
        self.state.update(record, batch_id=batch["id"], status=SUBMITTED)
        notice(f"part {record.number}: {len(record.lines)} request(s), {size:,} bytes → batch {batch['id']}")

    async def _find(self, record: PartRecord) -> dict[str, Any] | None:
        return await self.api.find(part_metadata(self.state.key, record.number), record.recorded_at - ADOPT_SLACK_S)

    async def _resume_recorded(self) -> None:
        """The parts an earlier run recorded and did not merge: wait for their batches (adopting one
        that was created but whose id was never recorded), or submit them if none was created."""
        for number, held in self.held.items():
            if self.stop.requested:
                raise Stopped
            record = self.state.parts[number]
            if not held:  # an earlier run handed every row over; only the mark was missing
                self.state.update(record, status=MERGED)
                continue
            if record.batch_id is not None:
                notice(f"part {number}: waiting for batch {record.batch_id} (submitted by an earlier run)")
            elif (batch := await self._find(record)) is not None:
                self.state.update(record, batch_id=batch["id"], status=SUBMITTED)
                notice(f"part {number}: adopted batch {batch['id']}, created before the earlier run stopped")
            else:
                await self._resubmit(record, held)
            self.inflight[number] = _InFlight(record, {r.custom_id: r for r in held})
        self.held.clear()

    async def _resubmit(self, record: PartRecord, held: list[BatchRequest]) -> None:
        """A recorded part whose batch was never created: submitted with the requests still not done."""
        self.state.update(record, lines=[r.line for r in held], file_id=None, status=UPLOADING)
        with self._spool(record.url) as file:
            for request in held:
                file.write(batch_line(request))
            await self._submit(record, file, file.tell())

    async def _poll(self) -> None:
        while self.inflight:
            for number, flight in list(self.inflight.items()):
                if self.stop.requested:
                    raise Stopped
                batch = await self.api.get(str(flight.record.batch_id))
                if batch["status"] in FINAL_STATUSES:
                    await self._merge(flight, batch)
                    del self.inflight[number]
                elif batch["status"] != flight.status:
                    counts = batch.get("request_counts") or {}
                    notice(f"part {number}: batch {batch['id']} {batch['status']} "
                        f"({counts.get('completed', 0) + counts.get('failed', 0)}/{counts.get('total', '?')})")
                flight.status = batch["status"]
            if self.inflight and await sleep_unless(self.stop, self.spec.poll_s):
                raise Stopped

    async def _merge(self, flight: _InFlight, batch: dict[str, Any]) -> None:
        """Every row of a final batch to the sink, each request once; the requests it left
        unanswered get a transient error (a re-run tries them again); then the part is merged."""
        pending, results, errors = dict(flight.requests), 0, 0
        for key in ("output_file_id", "error_file_id"):
            if file_id := batch.get(key):
                async with self.api.rows(file_id) as rows:
                    for row in rows:
                        request = pending.pop(str(row.get("custom_id")), None)
                        if request is not None:  # else done by an earlier run (or not ours: ignored)
                            ok = hand_row(self.sink, request, row)
                            results, errors = results + ok, errors + (not ok)
        status = batch["status"]
        why = "; ".join(str(e.get("message")) for e in ((batch.get("errors") or {}).get("data") or [])[:3])
        for request in pending.values():
            self.sink.error(request, UNANSWERED.get(status, ErrorCode.SERVER_ERROR),
                            f"batch {batch['id']} ended {status} without answering it" + (f" ({why})" if why else ""))
        self.state.update(flight.record, status=MERGED)
        notice(f"part {flight.record.number}: batch {batch['id']} {status}: {results} result(s), "
            f"{errors + len(pending)} error(s)")

    def say_left_running(self) -> None:
        running = [p for p in self.state.unmerged() if p.batch_id is not None]
        unsure = [p.number for p in self.state.unmerged() if p.batch_id is None]
        if running:
            notice(f"stopped: {len(running)} batch(es) keep running on the server "
                f"({', '.join(str(p.batch_id) for p in running)}); re-run the same command to collect their "
                f"results (the ids are in {self.state.path})")
        if unsure:
            notice(f"part(s) {', '.join(map(str, unsure))} stopped while being submitted: a re-run adopts their "
                "batches if they were created, else submits them")
