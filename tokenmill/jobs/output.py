"""The job's files: OpenAI batch output rows, appended one `write` at a time, and how a re-run
finds what is already done without reading them.

Exactly once rests on four things:
- a row is written with a single `os.write` of the whole line (newline included) on an
  O_APPEND descriptor, so a killed process leaves whole lines, and at worst (power loss, a full
  disk) one torn line at the end, which the next start cuts off;
- before each result row, its record goes to the done-index beside the results (`results.index`:
  the row's input line, its custom_id's key, a few flags, and the results file's length once the
  row is in). A re-run reads the index, not the rows: a record whose row is not in the results
  file (killed between the two writes) is dropped, and so are bytes past the last record;
- a re-run skips every line with a result or a *final* error, and retries the rest;
- `job.json` holds the input's identity and the options that change results, and a re-run with
  a different input or options refuses instead of mixing two jobs in one file.

These files are the job's journal, always on local disk. Where the results are also wanted as
parts (an object store output, or parquet), parts.py seals the journal's rows into committed
parts as the job goes (`Sealer`), and a resume counts those parts' index records instead.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np
import orjson

from tokenmill.jobs import storage
from tokenmill.jobs.seen_ids import id_key
from tokenmill.jobs.spec import InputError
from tokenmill.jobs.storage import Location
from tokenmill.openai_compat import new_id

INVALID_INPUT = "invalid_input"  # a bad input line (keyed by line number)
WORKER_ERROR = "worker_error"  # a Ray replica's backend raised on this request (see ray_runner.py)
# Failures worth another try: recorded, but retried when the job is re-run.
TRANSIENT_CODES = frozenset(
    {"rate_limited", "server_error", "timeout", "connection_error", "bad_response", WORKER_ERROR}
)
JOB_VERSION = 2  # 1: the input named by its whole sha256 (read before the first request)

# The done-index: a header (magic, and the results file's length when the index began: rows
# before it come from a version without one), then a record per result row, in row order.
INDEX_MAGIC = b"TMIDX001"
INDEX_HEADER = 16
INDEX_RECORD = np.dtype([("line", "<u4"), ("flags", "<u4"), ("key", "<i8"), ("end", "<u8")])
# Record flags: what the summary counts of rows done in earlier runs, without reading them.
STRUCTURED, ENDED_BY_LENGTH, MAX_TOKENS_DEFAULTED = 1, 2, 4
INDEX_CHECKS = 32  # records read back against their rows on every start (_matches_results)


class JobError(ValueError):
    """The job cannot start (or go on) as asked; the message says why and what to do."""


class JobFailed(JobError):
    """The job started but cannot go on (a Ray cluster stopped making progress, an endpoint stayed
    down past --retry-for); the rows written so far are kept, and re-running the same command resumes."""


@dataclass(frozen=True)
class IndexEntry:
    """What the done-index records of a result row (`INDEX_RECORD`)."""

    line: int
    key: int  # seen_ids.id_key(custom_id)
    flags: int  # STRUCTURED | ENDED_BY_LENGTH | MAX_TOKENS_DEFAULTED


def index_flags(structured: bool, max_tokens_defaulted: bool, body: dict[str, Any] | None) -> int:
    ended = finish_reason_of(body) == "length"
    return STRUCTURED * structured | MAX_TOKENS_DEFAULTED * max_tokens_defaulted | ENDED_BY_LENGTH * ended


class RowWriter(Protocol):
    """Where a `ResultSink` puts rows: the job's files, or a list on a Ray replica. `entry` comes
    with every result row (the done-index's record of it)."""

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None: ...


@dataclass(frozen=True)
class OutputPaths:
    results: Path
    errors: Path
    summary: Path
    job: Path
    backend_state: Path  # a backend's own state (KeepsState), e.g. the Batch API's batch ids
    index: Path  # the done-index of the results file

    @classmethod
    def from_option(cls, output: Path, errors: Path | None = None) -> OutputPaths:
        """`-o out/` → out/results.jsonl, errors.jsonl, summary.json, job.json;
        `-o res.jsonl` → res.jsonl, res.errors.jsonl, res.summary.json, res.job.json (and the
        done-index, results.index / res.index; backend.json / res.backend.json where a backend
        keeps state)."""
        if output.suffix == ".jsonl":
            stem = output.with_suffix("")
            default_errors = Path(f"{stem}.errors.jsonl")
            return cls(output, errors or default_errors, Path(f"{stem}.summary.json"), Path(f"{stem}.job.json"),
                       Path(f"{stem}.backend.json"), Path(f"{stem}.index"))
        return cls(output / "results.jsonl", errors or output / "errors.jsonl", output / "summary.json",
                   output / "job.json", output / "backend.json", output / "results.index")

    @property
    def data_files(self) -> tuple[Path, Path]:
        return self.results, self.errors

    @property
    def lock(self) -> Path:
        """Held while a run writes these files (guard.OutputLock): `results.lock`, `res.lock`."""
        return self.results.with_suffix(".lock")

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file a job writes here."""
        return (*self.data_files, self.summary, self.job, self.backend_state, self.index, self.lock)


# An error row names its input line at the start of its message: OpenAI's row has no field for it.
_LINE_PREFIX = "line {}: "
_LINE_OF_MESSAGE = re.compile(r"line (\d+): ")


# ---- rows --------------------------------------------------------------------------------------
def result_row(
    custom_id: str, body: dict[str, Any], request_id: str | None = None, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """OpenAI's batch output row; `metadata` (a CSV row's other columns) is the one field added,
    and only to the rows of a CSV job."""
    row = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id or new_id("req_"), "body": body},
        "error": None,
    }
    return row if metadata is None else {**row, "metadata": metadata}


def error_row(
    custom_id: str | None, line: int | None, code: str, message: str, response: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """OpenAI's error row; the input line, where given, leads the message ("line 7: ...") because a
    bad line may have no custom_id to tie it back. `response` is the server's reply for an HTTP
    error (status_code, request_id, body); `metadata` as in `result_row`."""
    prefix = "" if line is None else _LINE_PREFIX.format(line)
    row = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": response,
        "error": {"code": code, "message": prefix + message},
    }
    return row if metadata is None else {**row, "metadata": metadata}


def line_of(row: dict[str, Any]) -> int | None:
    """The input line an error row is about, read back from its message."""
    match = _LINE_OF_MESSAGE.match(str((row.get("error") or {}).get("message", "")))
    return int(match.group(1)) if match else None


def input_error_row(error: InputError) -> dict[str, Any]:
    return error_row(error.custom_id, error.line, INVALID_INPUT, error.reason)


def is_final(row: dict[str, Any]) -> bool:
    return (row.get("error") or {}).get("code") not in TRANSIENT_CODES


def finish_reason_of(body: dict[str, Any] | None) -> str | None:
    """The first choice's finish_reason in an OpenAI response body; None where missing."""
    choices = (body or {}).get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first.get("finish_reason") if isinstance(first, dict) else None


def answer_of(body: dict[str, Any] | None) -> str | None:
    """The first choice's text in an OpenAI response body (chat or completions); None where missing."""
    choices = (body or {}).get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict):
        return None
    text = (first.get("message") or {}).get("content") if "message" in first else first.get("text")
    return text if isinstance(text, str) else None


def usage_of(body: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from an OpenAI response body; zeros where missing."""
    usage = (body or {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}

    def count(value: Any) -> int:
        return value if isinstance(value, int) else 0

    return count(usage.get("prompt_tokens")), count(details.get("cached_tokens")), count(usage.get("completion_tokens"))


# ---- reading back and repairing ----------------------------------------------------------------
def repair_jsonl(path: Path, start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Read a JSONL file this module wrote, from byte `start`; cut a torn tail (no newline, or
    not JSON) off the file.

    Returns the rows and the number of bytes cut. A bad line *before* the last good one is not
    a torn write but a damaged file, and is refused rather than guessed at.
    """
    if not path.exists():
        return [], 0
    with path.open("rb") as f:
        f.seek(start)
        data = f.read()
    rows: list[dict[str, Any]] = []
    good_end = 0  # byte offset (in `data`) just past the last good line
    bad_line: int | None = None
    offset = 0
    for number, line in enumerate(io.BytesIO(data), start=1):  # split on b"\n" only
        end = offset + len(line)
        row = _parse_row(line)
        if row is not None and line.endswith(b"\n"):
            if bad_line is not None:
                raise JobError(
                    f"{path}: line {bad_line} is damaged but later lines are fine; this is not a torn "
                    "write from a crash. Fix or remove that line, or use --overwrite to start over"
                )
            rows.append(row)
            good_end = end
        elif line.strip() and bad_line is None:
            bad_line = number
        offset = end
    if good_end < len(data):
        _truncate(path, start + good_end)
    return rows, len(data) - good_end


def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())


def _parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a file's rows atomically (a crash leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(b"".join(encode_row(r) for r in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def encode_row(row: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # what orjson does not take (an integer past 64 bits): the standard library does
        return (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass
class OutputState:
    """What earlier runs of this job left in the output files, as a re-run needs it: which input
    lines are finished, and the counts the summary adds to this run's."""

    done_lines: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # [line]: has a result (index)
    done: int = 0  # rows with a result
    structured: int = 0  # … of those, asking for a structured output
    structured_cut: int = 0  # … and answered but ended by max_tokens
    max_tokens_defaulted: int = 0  # … done rows that gave no max_tokens
    # Results written before the job had an index (a job begun by an older tokenmill): by
    # custom_id, with whether max_tokens ended them; matched as the input is read.
    unindexed: dict[str, bool] = field(default_factory=dict)
    failed_lines: set[int] = field(default_factory=set)  # lines with a final error
    invalid_lines: set[int] = field(default_factory=set)  # bad input lines already recorded
    # The custom_id keys of the lines done (in the index), and their lines: a re-run skips them
    # unread, but a later line with the same id is still a duplicate.
    seen_keys: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    seen_lines: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint32))
    repaired_bytes: int = 0  # torn tail cut off the files
    retrying: int = 0  # transient errors dropped from the errors file, to be tried again
    index_rebuilt: bool = False  # the done-index did not match the results (edited by hand?): they were read
    duplicates_dropped: int = 0  # … and rows of a custom_id already there, cut from them

    def finished(self, line: int) -> bool:
        """Has a result or a final error: a re-run skips it without reading it."""
        return (line < len(self.done_lines) and bool(self.done_lines[line])) or line in self.failed_lines

    @property
    def failed(self) -> int:
        return len(self.failed_lines)


def scan_outputs(paths: OutputPaths) -> OutputState:
    """Repair torn tails, collect what is finished, drop transient errors so they are retried."""
    state = OutputState()
    found = read_index(paths.index, paths.results) if paths.index.exists() else None
    state.index_rebuilt = found is None and paths.index.exists()
    if found is not None:
        records, base, state.repaired_bytes = found
        unindexed = _rows_before(paths.results, base)
    else:  # a new job, one begun by a tokenmill without the index, or an index that lost its way
        unindexed, cut = repair_jsonl(paths.results)
        state.repaired_bytes += cut
        unique = _first_of_each_id(unindexed)
        if len(unique) < len(unindexed):  # answered twice: two runs wrote at once (before outputs were locked)
            state.duplicates_dropped = len(unindexed) - len(unique)
            rewrite_jsonl(paths.results, unique)
            unindexed = unique
        create_index(paths.index, paths.results.stat().st_size if paths.results.exists() else 0)
        records = np.empty(0, INDEX_RECORD)
    count_done(state, records)
    for row in unindexed:
        if isinstance(row.get("custom_id"), str):
            state.unindexed[row["custom_id"]] = finish_reason_of((row.get("response") or {}).get("body")) == "length"
    scan_errors(state, paths.errors)
    return state


def _first_of_each_id(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows, less any whose custom_id an earlier row has (ids are unique in an input)."""
    seen: set[str] = set()
    kept = []
    for row in rows:
        custom_id = row.get("custom_id")
        if isinstance(custom_id, str):
            if custom_id in seen:
                continue
            seen.add(custom_id)
        kept.append(row)
    return kept


def _rows_before(path: Path, end: int) -> list[dict[str, Any]]:
    if not end:
        return []
    with path.open("rb") as f:
        data = f.read(end)
    return [row for line in io.BytesIO(data) if (row := _parse_row(line)) is not None]


def count_done(state: OutputState, records: np.ndarray) -> None:
    """The done lines, ids and counts of these done-index records (the results', or committed
    parts': parts.py) into `state`."""
    lines, flags = records["line"], records["flags"]
    state.done_lines = np.zeros(int(lines.max(initial=0)) + 1, bool)
    state.done_lines[lines] = True
    state.done = len(records)
    structured = (flags & STRUCTURED) != 0
    state.structured = int(structured.sum())
    state.structured_cut = int((structured & ((flags & ENDED_BY_LENGTH) != 0)).sum())
    state.max_tokens_defaulted = int(((flags & MAX_TOKENS_DEFAULTED) != 0).sum())
    state.seen_keys, state.seen_lines = records["key"].copy(), lines.copy()


def scan_errors(state: OutputState, path: Path) -> None:
    """The errors file's final errors into `state` (after the done lines are in); its transient
    ones are dropped from the file, to be tried again."""
    errors, cut = repair_jsonl(path)
    state.repaired_bytes += cut
    final = [r for r in errors if is_final(r)]
    if len(final) < len(errors):
        state.retrying = len(errors) - len(final)
        rewrite_jsonl(path, final)
    for row in final:
        line = line_of(row)
        if line is None:
            continue
        if (row.get("error") or {}).get("code") == INVALID_INPUT:
            state.invalid_lines.add(line)
        elif not state.finished(line) and row.get("custom_id") not in state.unindexed:
            state.failed_lines.add(line)  # read again as the input is (its id is taken then), not run


# ---- the done-index --------------------------------------------------------------------------------
def read_index(index: Path, results: Path) -> tuple[np.ndarray, int, int] | None:
    """The done-index's records whose rows are in the results file, the results' length where the
    index began (rows before it are read by custom_id), and the bytes cut off the results (a torn
    row, or rows whose records a power cut lost: not known done, so done again). None, touching
    nothing, when the index does not describe this results file (not an index, or rows edited
    by hand): the results are then read instead."""
    size = results.stat().st_size if results.exists() else 0
    with index.open("rb") as f:
        header = f.read(INDEX_HEADER)
        if len(header) < INDEX_HEADER or header[:8] != INDEX_MAGIC:
            return None
        base = int.from_bytes(header[8:], "little")
        records = np.fromfile(f, INDEX_RECORD, (index.stat().st_size - INDEX_HEADER) // INDEX_RECORD.itemsize)
    if base > size or not _in_row_order(records, base):
        return None
    kept = _committed(records, base, results, size)
    if kept is None or not _matches_results(records[:kept], base, results):
        return None
    if index.stat().st_size != INDEX_HEADER + kept * INDEX_RECORD.itemsize:
        _truncate(index, INDEX_HEADER + kept * INDEX_RECORD.itemsize)  # records whose rows never made it
    end = int(records["end"][kept - 1]) if kept else base
    if size > end:
        _truncate(results, end)
    return records[:kept], base, size - end


def _in_row_order(records: np.ndarray, base: int) -> bool:
    """Whether each record's row ends past the one before (past `base`, the first): not so when
    two runs wrote one output at once (an older tokenmill had no lock), or the index was edited."""
    ends = records["end"]
    return not len(ends) or (int(ends[0]) > base and bool(np.all(ends[1:] > ends[:-1])))


def _committed(records: np.ndarray, base: int, results: Path, size: int) -> int | None:
    """How many records, from the first, have their rows in the results: those that end within
    the file (a kill between a record and its row leaves one that does not), the last of them
    read back and checked (after a power cut the file may be long enough and hold zeros). None
    when records were dropped and a whole row follows the last one kept: not a power cut's
    garbage, but rows this index does not describe."""
    within = kept = int(np.searchsorted(records["end"], size, side="right"))
    if not kept:
        return 0
    with results.open("rb") as f:
        while kept and not _row_matches(f, records, base, kept - 1):
            kept -= 1
        if kept < within:
            f.seek(int(records["end"][kept - 1]) if kept else base)
            line = f.readline()
            if line.endswith(b"\n") and _parse_row(line) is not None:
                return None
    return kept


def _row_matches(f: IO[bytes], records: np.ndarray, base: int, i: int) -> bool:
    """Whether record `i`'s bytes in the results are a row with its custom_id."""
    start = int(records["end"][i - 1]) if i else base
    f.seek(start)
    row = _parse_row(f.read(int(records["end"][i]) - start))
    return row is not None and id_key(str(row.get("custom_id"))) == int(records["key"][i])


def _matches_results(records: np.ndarray, base: int, results: Path) -> bool:
    """A sample of the records checked against their rows: an index that does not describe this
    results file (rows deleted or reordered by hand) is caught, and not believed."""
    if not len(records):
        return True
    sample = np.random.default_rng().choice(len(records), min(len(records), INDEX_CHECKS), replace=False)
    with results.open("rb") as f:
        return all(_row_matches(f, records, base, int(i)) for i in sample)


def create_index(index: Path, base: int) -> None:
    """An empty done-index for a results file `base` bytes long (written atomically)."""
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_bytes(INDEX_MAGIC + base.to_bytes(8, "little"))
    os.replace(tmp, index)


def read_index_records(index: Path, first: int, last: int) -> np.ndarray:
    """Records `first` to `last` (not included) of a done-index, read from the file."""
    with index.open("rb") as f:
        f.seek(INDEX_HEADER + first * INDEX_RECORD.itemsize)
        return np.fromfile(f, INDEX_RECORD, last - first)


# ---- appending -----------------------------------------------------------------------------------
@dataclass
class Appender:
    """Appends bytes with one write each; fsyncs at most every `fsync_interval` seconds.

    A killed process loses nothing that `write` returned (it is in the OS page cache); fsync only
    matters if the machine itself goes down. Measured in docs/jobs.md: an fsync per line costs
    ~nothing next to a generation, but batching them keeps fast endpoints from being disk-bound.
    """

    path: Path
    fsync_interval: float = 1.0  # 0 = fsync every row
    _fd: int = field(default=-1, init=False)
    _last_sync: float = field(default=0.0, init=False)
    _dirty: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_sync = time.monotonic()

    @property
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def write_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:  # a regular file takes it whole; loop only for the odd short write
                view = view[os.write(self._fd, view):]
        except OSError as exc:  # a full disk: the error names the file (a descriptor's has no name)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc
        self._dirty = True

    def due(self) -> bool:
        return time.monotonic() - self._last_sync >= self.fsync_interval

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1


class JsonlAppender(Appender):
    """Rows, a line each (the errors file; the server's Batch API files)."""

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None:
        self.write_bytes(encode_row(row))
        if self.due():
            self.sync()


class Sealer(Protocol):
    """Told of every result row written (the journal's record count and length after it) and of
    the end: parts.PartSealer, which cuts the journal into committed parts."""

    def wrote(self, records: int, end: int) -> None: ...

    def close(self, records: int, end: int) -> None: ...


class IndexedResults:
    """The results file and its done-index: each row's record first, then the row (see the module
    docstring). The index is synced before the rows, so a power cut keeps no row without its record."""

    _pack = np.empty(1, INDEX_RECORD)

    def __init__(self, results: Path, index: Path, fsync_interval: float = 1.0, sealer: Sealer | None = None) -> None:
        self._rows = Appender(results, fsync_interval)
        self._index = Appender(index, fsync_interval)
        self._end = self._rows.size
        self._records = (self._index.size - INDEX_HEADER) // INDEX_RECORD.itemsize
        self._sealer = sealer

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None:
        if entry is None:
            raise ValueError("a result row needs its index entry")
        data = encode_row(row)
        self._end += len(data)
        record = self._pack
        record[0] = (entry.line, entry.flags, entry.key, self._end)
        self._index.write_bytes(record.tobytes())
        self._rows.write_bytes(data)
        self._records += 1
        if self._rows.due():
            self.sync()
        if self._sealer is not None:
            self._sealer.wrote(self._records, self._end)

    def sync(self) -> None:
        self._index.sync()
        self._rows.sync()

    def close(self) -> None:
        """Sync and close; with a sealer, the rows since its last part become one more."""
        self._index.close()
        self._rows.close()
        if self._sealer is not None:
            self._sealer.close(self._records, self._end)


# ---- the job's identity --------------------------------------------------------------------------
def job_record(input_path: Location, identity: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """What job.json holds: the input's identity (spec.input_identity) and the settings that
    change results."""
    canonical = json.dumps({"input": identity, "settings": settings}, sort_keys=True)
    return {
        "version": JOB_VERSION,
        "fingerprint": hashlib.sha256(canonical.encode()).hexdigest(),
        "input": str(input_path),
        "input_identity": identity,
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _version_1_fingerprint(input_path: Location, settings: dict[str, Any]) -> str:
    """A job.json of version 1 named its input by the whole file's sha256."""
    digest = hashlib.sha256()
    with storage.open_input(input_path) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    canonical = json.dumps({"input_sha256": digest.hexdigest(), "settings": settings}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def claim_outputs(paths: OutputPaths, job: dict[str, Any], overwrite: bool) -> bool:
    """Make the output files this job's. Returns True when resuming an earlier run of it.

    Refuses (JobError) when they belong to a different job, or to none we know of.
    """
    if overwrite:
        for path in (*paths.data_files, paths.summary, paths.job, paths.backend_state, paths.index):
            path.unlink(missing_ok=True)
    existing = [p for p in paths.data_files if p.exists() and p.stat().st_size > 0]
    if paths.job.exists():
        check_same_job(paths.job.read_bytes(), job, str(paths.job), str(paths.results))
        return True
    if existing:
        raise JobError(
            f"{existing[0]} already exists but has no {paths.job.name} beside it, so it was not started by "
            "this job; choose another -o, or add --overwrite to replace it"
        )
    paths.job.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.job, job)
    return False


def check_same_job(recorded: bytes, job: dict[str, Any], where: str, results: str) -> None:
    """Refuse (JobError) when the job.json `recorded` (read from `where`) is another job's than
    `job`: `results` names the output in the message."""
    try:
        old = json.loads(recorded)
    except ValueError as exc:
        raise JobError(f"{where} is not valid JSON ({exc}); use --overwrite to start over") from None
    if old.get("version") == 1:
        same = old.get("fingerprint") == _version_1_fingerprint(storage.location(job["input"]), job["settings"])
    else:
        same = old.get("fingerprint") == job["fingerprint"]
    if not same:
        raise JobError(_mismatch_message(results, old, job))


def _setting(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _mismatch_message(results: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    reasons = []
    if "input_identity" in old and old["input_identity"] != new["input_identity"]:
        was, now = old["input_identity"], new["input_identity"]
        reasons.append(
            f"the input differs (it was {old.get('input')!r}, {was.get('size')} bytes, ends sha256 "
            f"{str(was.get('ends_sha256'))[:12]}…; now {new['input']!r}, {now['size']} bytes, "
            f"ends sha256 {now['ends_sha256'][:12]}…)"
        )
    old_settings, new_settings = old.get("settings") or {}, new["settings"]
    for key in sorted(old_settings.keys() | new_settings.keys()):
        if old_settings.get(key) != new_settings.get(key):
            reasons.append(f"{key} was {_setting(old_settings.get(key))}, now {_setting(new_settings.get(key))}")
    if "input_identity" not in old and not reasons:  # version 1: only its whole-file sha256 was kept
        reasons.append(f"the input differs from the one it was started on ({old.get('input')!r}, by its sha256)")
    return (
        f"{results} belongs to a different job: {'; '.join(reasons) or 'its fingerprint differs'}. "
        "Re-run with the original input and options to resume it, choose another -o, "
        "or add --overwrite to discard it"
    )


def write_json_atomic(path: Path, doc: dict[str, Any], fsync: bool = False) -> None:
    """`fsync`: durable before it replaces the old one (parts.py's seal marker), not just atomic."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
