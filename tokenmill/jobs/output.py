"""The job's files: OpenAI batch output rows, appended one `write` at a time, and how a re-run
finds what is already done.

Exactly once rests on three things:
- a row is written with a single `os.write` of the whole line (newline included) on an
  O_APPEND descriptor, so a killed process leaves whole lines, and at worst (power loss, a full
  disk) one torn line at the end, which `repair_jsonl` cuts off on the next start;
- a re-run skips every custom_id that has a result or a *final* error, and retries the rest;
- `job.json` holds the input's sha256 and the options that change results, and a re-run with
  a different input or options refuses instead of mixing two jobs in one file.
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
from typing import Any, Protocol

from tokenmill.jobs.spec import InputError
from tokenmill.openai_compat import new_id

INVALID_INPUT = "invalid_input"  # a bad input line (keyed by line number)
WORKER_ERROR = "worker_error"  # a Ray replica's backend raised on this request (see ray_runner.py)
# Failures worth another try: recorded, but retried when the job is re-run.
TRANSIENT_CODES = frozenset(
    {"rate_limited", "server_error", "timeout", "connection_error", "bad_response", WORKER_ERROR}
)
JOB_VERSION = 1


class JobError(ValueError):
    """The job cannot start (or go on) as asked; the message says why and what to do."""


class JobFailed(JobError):
    """The job started but cannot go on (a Ray cluster stopped making progress, an endpoint stayed
    down past --retry-for); the rows written so far are kept, and re-running the same command resumes."""


class RowWriter(Protocol):
    """Where a `ResultSink` puts rows: a `JsonlAppender`, or a list on a Ray replica."""

    def write(self, row: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class OutputPaths:
    results: Path
    errors: Path
    summary: Path
    job: Path

    @classmethod
    def from_option(cls, output: Path, errors: Path | None = None) -> OutputPaths:
        """`-o out/` → out/results.jsonl, errors.jsonl, summary.json, job.json;
        `-o res.jsonl` → res.jsonl, res.errors.jsonl, res.summary.json, res.job.json."""
        if output.suffix == ".jsonl":
            stem = output.with_suffix("")
            default_errors = Path(f"{stem}.errors.jsonl")
            return cls(output, errors or default_errors, Path(f"{stem}.summary.json"), Path(f"{stem}.job.json"))
        return cls(output / "results.jsonl", errors or output / "errors.jsonl",
                   output / "summary.json", output / "job.json")

    @property
    def data_files(self) -> tuple[Path, Path]:
        return self.results, self.errors


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
def repair_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Read a JSONL file this module wrote; cut a torn tail (no newline, or not JSON) off the file.

    Returns the rows and the number of bytes cut. A bad line *before* the last good one is not
    a torn write but a damaged file, and is refused rather than guessed at.
    """
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    rows: list[dict[str, Any]] = []
    good_end = 0  # byte offset just past the last good line
    bad_line: int | None = None
    start = 0
    for number, line in enumerate(io.BytesIO(data), start=1):  # split on b"\n" only
        end = start + len(line)
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
        start = end
    if good_end < len(data):
        with path.open("r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return rows, len(data) - good_end


def _parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
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
    return (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


@dataclass
class OutputState:
    """What earlier runs of this job left in the output files."""

    done: set[str] = field(default_factory=set)  # custom_ids with a result
    ended_by_length: set[str] = field(default_factory=set)  # custom_ids with a result max_tokens ended
    failed: set[str] = field(default_factory=set)  # custom_ids with a final error
    invalid_lines: set[int] = field(default_factory=set)  # bad input lines already recorded
    repaired_bytes: int = 0  # torn tail cut off the files
    retrying: int = 0  # transient errors dropped from the errors file, to be tried again


def scan_outputs(paths: OutputPaths) -> OutputState:
    """Repair torn tails, collect what is finished, drop transient errors so they are retried."""
    state = OutputState()
    results, cut = repair_jsonl(paths.results)
    state.repaired_bytes += cut
    state.done = {r["custom_id"] for r in results if isinstance(r.get("custom_id"), str)}
    state.ended_by_length = {r["custom_id"] for r in results if isinstance(r.get("custom_id"), str)
                             and finish_reason_of((r.get("response") or {}).get("body")) == "length"}
    errors, cut = repair_jsonl(paths.errors)
    state.repaired_bytes += cut
    final = [r for r in errors if is_final(r)]
    if len(final) < len(errors):
        state.retrying = len(errors) - len(final)
        rewrite_jsonl(paths.errors, final)
    for row in final:
        if (row.get("error") or {}).get("code") == INVALID_INPUT:
            line = line_of(row)
            if line is not None:
                state.invalid_lines.add(line)
        elif isinstance(row.get("custom_id"), str) and row["custom_id"] not in state.done:
            state.failed.add(row["custom_id"])
    return state


# ---- appending -----------------------------------------------------------------------------------
@dataclass
class JsonlAppender:
    """Appends rows with one write each; fsyncs at most every `fsync_interval` seconds.

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

    def write(self, row: dict[str, Any]) -> None:
        data = memoryview(encode_row(row))
        while data:  # a regular file takes it whole; loop only for the odd short write
            data = data[os.write(self._fd, data):]
        self._dirty = True
        if time.monotonic() - self._last_sync >= self.fsync_interval:
            self.sync()

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


# ---- the job's identity --------------------------------------------------------------------------
def job_record(input_path: Path, input_sha256: str, settings: dict[str, Any]) -> dict[str, Any]:
    """What job.json holds: the input's hash and the settings that change results."""
    canonical = json.dumps({"input_sha256": input_sha256, "settings": settings}, sort_keys=True)
    return {
        "version": JOB_VERSION,
        "fingerprint": hashlib.sha256(canonical.encode()).hexdigest(),
        "input": str(input_path),
        "input_sha256": input_sha256,
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def claim_outputs(paths: OutputPaths, job: dict[str, Any], overwrite: bool) -> bool:
    """Make the output files this job's. Returns True when resuming an earlier run of it.

    Refuses (JobError) when they belong to a different job, or to none we know of.
    """
    if overwrite:
        for path in (*paths.data_files, paths.summary, paths.job):
            path.unlink(missing_ok=True)
    existing = [p for p in paths.data_files if p.exists() and p.stat().st_size > 0]
    if paths.job.exists():
        try:
            old = json.loads(paths.job.read_text())
        except ValueError as exc:
            raise JobError(f"{paths.job} is not valid JSON ({exc}); use --overwrite to start over") from None
        if old.get("fingerprint") != job["fingerprint"]:
            raise JobError(_mismatch_message(paths, old, job))
        return True
    if existing:
        raise JobError(
            f"{existing[0]} already exists but has no {paths.job.name} beside it, so it was not started by "
            "this job; choose another -o, or add --overwrite to replace it"
        )
    paths.job.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.job, job)
    return False


def _setting(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _mismatch_message(paths: OutputPaths, old: dict[str, Any], new: dict[str, Any]) -> str:
    reasons = []
    if old.get("input_sha256") != new["input_sha256"]:
        reasons.append(
            f"the input differs (it was {old.get('input')!r}, sha256 {str(old.get('input_sha256'))[:12]}…; "
            f"now {new['input']!r}, sha256 {new['input_sha256'][:12]}…)"
        )
    old_settings, new_settings = old.get("settings") or {}, new["settings"]
    for key in sorted(old_settings.keys() | new_settings.keys()):
        if old_settings.get(key) != new_settings.get(key):
            reasons.append(f"{key} was {_setting(old_settings.get(key))}, now {_setting(new_settings.get(key))}")
    return (
        f"{paths.results} belongs to a different job: {'; '.join(reasons) or 'its fingerprint differs'}. "
        "Re-run with the original input and options to resume it, choose another -o, "
        "or add --overwrite to discard it"
    )


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
