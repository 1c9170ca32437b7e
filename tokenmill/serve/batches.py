"""The Batch API: files and batches kept on disk, each batch run by the job runner (`run_job`)
on the server's engine loop (or its embedding model), so it is validated, written and resumed exactly
like `tokenmill run`.

Layout under the state directory:
  files/<file_id>.json         the file object (+ where its bytes are)
  files/<file_id>.jsonl        uploaded bytes
  batches/<batch_id>.json      the batch object, rewritten atomically at every status change
  batches/<batch_id>/          the job's output folder: results.jsonl, errors.jsonl, job.json, summary.json

A batch that was validating / in_progress / finalizing when the server stopped is run again at
start-up; the job runner skips every line that already has a result.

A batch still unfinished when its completion window closes is stopped and ends `expired`: the
rows already written stay, every request without one gets a `batch_expired` error row.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from rich.console import Console

from tokenmill.jobs import JobConfig, JobError, run_job
from tokenmill.jobs.backends import Backend, StopFlag
from tokenmill.jobs.input import DocumentOptions, InputFile, LineError, json_object_line, read_input
from tokenmill.jobs.journal import JsonlAppender, OutputPaths
from tokenmill.jobs.results import error_row, read_rows, usage_of
from tokenmill.jobs.storage import atomic_write_json
from tokenmill.openai_compat import (
    BATCH_ID_PREFIX,
    FILE_ID_PREFIX,
    SUPPORTED_URLS,
    RequestError,
    check_text,
    id_format,
    is_own_id,
    json_path,
    new_id,
)
from tokenmill.serve.errors import APIError, bad_request, from_value_error
from tokenmill.serve.limits import too_large

log = logging.getLogger(__name__)

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOWS = {"24h": 24 * 3600}  # the one window OpenAI accepts, in seconds
OUTPUT_EXPIRY_SECONDS = (3600, 30 * 24 * 3600)  # OpenAI's bounds on output_expires_after.seconds
DEADLINE_POLL_S = 0.25  # how soon a running batch notices that its window has closed
EXPIRED_CODE = "batch_expired"
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."  # OpenAI's words
MAX_LISTED_LINE_ERRORS = 20  # a failed batch's `errors` names at most this many bad lines
# OpenAI's limits on a batch's `metadata`: it is stored, rewritten at every status change and
# listed, so a client must not make it large.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

Clock = Callable[[], float]  # Unix time in seconds


class FileStore:
    def __init__(self, root: Path, clock: Clock = time.time) -> None:
        self.root = root / "files"
        self.root.mkdir(parents=True, exist_ok=True)
        self._clock = clock

    def create(self, data: bytes, filename: str, purpose: str, path: Path | None = None,
               expires_after: int | None = None) -> dict[str, Any]:
        """Store bytes, or register a file the server wrote (`path`, e.g. a batch's results);
        with `expires_after`, the file is deleted that many seconds from now."""
        file_id = new_id(FILE_ID_PREFIX)
        if path is None:
            path = self.root / f"{file_id}.jsonl"
            path.write_bytes(data)
        return self._register(file_id, path, filename, purpose, expires_after)

    def upload(self, source: BinaryIO, filename: str, purpose: str, max_bytes: int,
               max_line_bytes: int) -> dict[str, Any]:
        """Copy an uploaded batch input in, line by line, checking that it is JSONL as it goes.

        Refused (APIError, nothing kept) when it is over `max_bytes` (413), has a line over
        `max_line_bytes` or one that is not a UTF-8 JSON object, or has no request at all (400).
        Blocking (a 200 MB file takes seconds to check): the route calls it on a worker thread."""
        file_id = new_id(FILE_ID_PREFIX)
        path = self.root / f"{file_id}.jsonl"
        partial = path.with_suffix(".part")  # never seen by get() or list(): no .json beside it
        try:
            with partial.open("wb") as out:
                _copy_jsonl(source, out, max_bytes, max_line_bytes)
            partial.rename(path)
        finally:
            partial.unlink(missing_ok=True)
        return self._register(file_id, path, filename, purpose)

    def get(self, file_id: str) -> dict[str, Any]:
        """The file object; 404 for an id this server did not make, exactly as it made it."""
        obj = None
        if is_own_id(file_id, FILE_ID_PREFIX):
            try:
                obj = json.loads(self._meta(file_id).read_text())
            except (OSError, ValueError):  # no such file (deleted, never made)
                obj = None
        if obj is None or self._expire(obj):
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
        return obj

    def path(self, file_id: str) -> Path:
        return Path(self.get(file_id)["_path"])

    def list(self, purpose: str | None = None) -> list[dict[str, Any]]:
        """Every file (with `purpose`, only those), newest first."""
        files = []
        for meta in self.root.glob("*.json"):
            try:
                obj = json.loads(meta.read_text())
            except FileNotFoundError:  # deleted since the glob
                continue
            if (purpose is None or obj["purpose"] == purpose) and not self._expire(obj):
                files.append(obj)
        return sorted(files, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete(self, file_id: str) -> dict[str, Any]:
        self._remove(self.get(file_id))  # a 404 for an unknown id
        return {"id": file_id, "object": "file", "deleted": True}

    def _remove(self, obj: dict[str, Any]) -> None:
        self._meta(obj["id"]).unlink(missing_ok=True)  # first: from here on the file is gone for everyone
        Path(obj["_path"]).unlink(missing_ok=True)

    def _expire(self, obj: dict[str, Any]) -> bool:
        """Whether the file is past its `expires_at`; if so it is deleted (when first looked at)."""
        expires_at = obj.get("expires_at")
        if expires_at is None or self._clock() < expires_at:
            return False
        self._remove(obj)
        return True

    def _meta(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"  # an id checked by `get` (is_own_id): never a path

    def _register(self, file_id: str, path: Path, filename: str, purpose: str,
                  expires_after: int | None = None) -> dict[str, Any]:
        now = int(self._clock())
        obj = {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": now,
               "expires_at": None if expires_after is None else now + expires_after,
               "filename": filename, "purpose": purpose, "status": "processed", "_path": str(path)}
        atomic_write_json(self.root / f"{file_id}.json", obj)
        return obj


def _copy_jsonl(source: BinaryIO, out: BinaryIO, max_bytes: int, max_line_bytes: int) -> None:
    """Copy `source` to `out` a line at a time (never more than `max_line_bytes` in memory),
    refusing at the first line that is not a JSON object and at `max_bytes` in all."""
    copied, request_lines = 0, 0
    for number in itertools.count(1):
        line = source.readline(max_line_bytes + 1)  # +1: a longer line is cut there, and seen to be
        if not line:
            break
        copied += len(line)
        if copied > max_bytes:
            raise too_large("the file", max_bytes, "--max-upload-bytes")
        if len(line.rstrip(b"\r\n")) > max_line_bytes:
            raise bad_request(f"line {number}: longer than {max_line_bytes} bytes, the limit for one request "
                              "(--max-request-bytes)", param="file")
        request_lines += _check_line(line, number)
        out.write(line)
    if not request_lines:
        raise bad_request("the file has no requests: a batch input is one JSON object per line", param="file")


def _check_line(line: bytes, number: int) -> bool:
    """Whether the line is a request (False: blank); a 400 naming the line if it is not a JSON
    object (the job reader's rules, so a file accepted here reads there)."""
    if not line.strip():
        return False
    try:
        json_object_line(line, number)
    except LineError as exc:
        raise bad_request(f"line {number}: {exc}", param="file") from None
    return True


def public(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


class BatchManager:
    """Batches run one at a time, in creation order, on a worker thread."""

    def __init__(self, root: Path, files: FileStore, make_backend: Callable[[str, str], Backend],
                 model: str, check_endpoint: Callable[[str], None], clock: Clock = time.time) -> None:
        """`make_backend(batch_id, endpoint)`: what runs a batch; `model`: the served model, which runs
        every batch; `check_endpoint`: the 400 for an endpoint it does not answer; `clock`: Unix
        time, for deadlines."""
        self.root = root / "batches"
        self.root.mkdir(parents=True, exist_ok=True)
        self.files, self._make_backend, self.model, self._clock = files, make_backend, model, clock
        self._check_endpoint = check_endpoint
        self._lock = threading.RLock()  # status changes come from the worker and from cancel
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._stops: dict[str, StopFlag] = {}  # the running batch's stop flag
        self._shutdown = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        for obj in sorted(self._all(), key=lambda b: b["created_at"]):
            if obj["status"] == "cancelling":
                self._update(obj["id"], status="cancelled", cancelled_at=self._now())
            elif obj["status"] in ACTIVE:
                log.info("resuming batch %s (%s)", obj["id"], obj["status"])
                self._queue.put(obj["id"])
        self._thread = threading.Thread(target=self._work, name="tokenmill-batches", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop like a crash would: unfinished batches stay active on disk and resume at next start."""
        self._shutdown = True
        for stop in list(self._stops.values()):
            stop.request()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=60)

    # ---- the API ----------------------------------------------------------------------------------
    def create(self, input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None,
               output_expires_after: dict[str, Any] | None = None) -> dict[str, Any]:
        if endpoint not in SUPPORTED_URLS:
            raise bad_request(f"endpoint must be one of {list(SUPPORTED_URLS)}, got {endpoint!r}", param="endpoint")
        self._check_endpoint(endpoint)
        if completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {list(COMPLETION_WINDOWS)}, got {completion_window!r}",
                              param="completion_window")
        _check_metadata(metadata)
        _check_output_expiry(output_expires_after)
        # The id is stored as given, so it must be exactly one the server made (`files.get` takes no
        # other): not a file id at all is a 400, in OpenAI's words; one that could be, an unknown one (404).
        if not input_file_id.startswith(FILE_ID_PREFIX):
            raise bad_request(f"Invalid 'input_file_id': {input_file_id!r}. Expected an ID that begins with "
                              f"{FILE_ID_PREFIX!r} ({id_format(FILE_ID_PREFIX)}, as POST /v1/files returns it)",
                              param="input_file_id", code="invalid_value")
        file = self.files.get(input_file_id)
        if file["purpose"] != "batch":
            raise bad_request(f"file {input_file_id} has purpose {file['purpose']!r}, not 'batch'",
                              param="input_file_id")
        now = self._now()
        obj = {"id": new_id(BATCH_ID_PREFIX), "object": "batch", "endpoint": endpoint, "model": self.model,
               "errors": None, "input_file_id": input_file_id, "completion_window": completion_window,
               "status": "validating",
               "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
               "expires_at": now + COMPLETION_WINDOWS[completion_window], "finalizing_at": None,
               "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None,
               "cancelled_at": None, "request_counts": {"total": 0, "completed": 0, "failed": 0},
               "usage": None, "metadata": metadata, "output_expires_after": output_expires_after}
        self._save(obj)
        self._queue.put(obj["id"])
        return obj

    def get(self, batch_id: str) -> dict[str, Any]:
        """The batch object; 404 for an id this server did not make, exactly as it made it."""
        try:
            if not is_own_id(batch_id, BATCH_ID_PREFIX):
                raise FileNotFoundError(batch_id)
            text = (self.root / f"{batch_id}.json").read_text()
        except OSError:  # no such batch
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found") from None
        obj = {**BATCH_FIELDS_ADDED_LATER, **json.loads(text)}
        if obj["status"] in ("in_progress", "cancelling"):  # live counts, straight from the output files
            counts = obj["request_counts"]
            counts["completed"], counts["failed"] = self._count_rows(batch_id)
        return obj

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        batches = sorted(self._all(), key=lambda b: (b["created_at"], b["id"]), reverse=True)
        if after:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = [self.get(b["id"]) for b in batches[:limit]]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}

    def reading(self, file_id: str) -> str | None:
        """The id of an active batch whose input is `file_id`, if any (such a file is not deleted)."""
        return next((b["id"] for b in self._all() if b["status"] in ACTIVE and b["input_file_id"] == file_id), None)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            obj = self.get(batch_id)
            if obj["status"] not in ("validating", "in_progress"):
                raise APIError(409, f"cannot cancel a batch that is {obj['status']}", param="batch_id")
            obj = self._update(batch_id, status="cancelling", cancelling_at=self._now())
            stop = self._stops.get(batch_id)
        if stop is not None:
            stop.request()
        return obj

    # ---- the worker -------------------------------------------------------------------------------
    def _work(self) -> None:
        while (batch_id := self._queue.get()) is not None:
            if self._shutdown:
                return
            try:
                self._run(batch_id)
            except Exception as exc:  # a bug must fail the batch, not the worker
                log.exception("batch %s failed", batch_id)
                self._fail(batch_id, [_batch_error("server_error", f"{type(exc).__name__}: {exc}")])

    def _run(self, batch_id: str) -> None:
        obj = self.get(batch_id)
        if obj["status"] == "cancelling":
            self._update(batch_id, status="cancelled", cancelled_at=self._now())
            return
        backend = self._make_backend(batch_id, obj["endpoint"])
        input_path = self.files.path(obj["input_file_id"])
        try:
            spec = read_input(input_path, DocumentOptions(), "batch", backend.check)
        except (OSError, ValueError) as exc:
            self._fail(batch_id, [_batch_error("invalid_file", str(exc))])
            return
        if not spec.entries:
            self._fail(batch_id, _line_errors(spec))
            return
        stop = StopFlag()
        with self._lock:
            if self.get(batch_id)["status"] == "cancelling" or self._past_deadline(obj):
                stop.request()  # nothing runs: a cancel that came in while validating wins, a late batch expires
            else:
                self._update(batch_id, status="in_progress", in_progress_at=obj["in_progress_at"] or self._now(),
                             request_counts={"total": spec.num_lines, "completed": 0, "failed": 0})
            self._stops[batch_id] = stop
        job_over = self._stop_at_deadline(obj["expires_at"], stop)
        try:
            self._run_job(batch_id, input_path, backend, stop)
        finally:
            job_over.set()
            del self._stops[batch_id]
        if not self._shutdown:
            self._finalize(batch_id, spec)

    def _stop_at_deadline(self, deadline: int, stop: StopFlag) -> threading.Event:
        """Stops the job once the clock reaches `deadline`; set the event returned when the job is over."""
        job_over = threading.Event()

        def watch() -> None:
            while not job_over.wait(DEADLINE_POLL_S):
                if self._clock() >= deadline:
                    stop.request()  # in-flight requests are aborted, their lines left without a row
                    return

        threading.Thread(target=watch, name="tokenmill-batch-deadline", daemon=True).start()
        return job_over

    def _run_job(self, batch_id: str, input_path: Path, backend: Backend, stop: StopFlag) -> None:
        config = JobConfig(input=input_path, output=self.root / batch_id, input_format="batch", progress=False)
        try:
            run_job(config, backend, console=Console(quiet=True), stop=stop)
        except JobError as exc:
            self._fail(batch_id, [_batch_error("invalid_file", str(exc))])

    def _finalize(self, batch_id: str, spec: InputFile) -> None:
        obj = self.get(batch_id)
        if obj["status"] == "failed":
            return
        out_dir = self.root / batch_id
        if obj["status"] == "cancelling":  # what finished is kept; the rest is simply not run
            final = {"status": "cancelled", "cancelled_at": self._now()}
        elif self._past_deadline(obj) and self._expire_unfinished(out_dir, spec):
            final = {"status": "expired", "expired_at": self._now()}
        else:
            self._update(batch_id, status="finalizing", finalizing_at=self._now())
            final = {"status": "completed", "completed_at": self._now()}
        completed, failed = self._count_rows(batch_id)
        expiry = (obj["output_expires_after"] or {}).get("seconds")
        ids = {}
        job = OutputPaths.from_option(out_dir)
        outputs = (("output_file_id", job.results, completed), ("error_file_id", job.errors, failed))
        for key, path, rows in outputs:
            if rows:
                ids[key] = self.files.create(b"", f"{batch_id}_{path.name}", "batch_output", path,
                                             expires_after=expiry)["id"]
        counts = {"total": spec.num_lines, "completed": completed, "failed": failed}
        self._update(batch_id, request_counts=counts, usage=_usage(job.results), **ids, **final)

    def _expire_unfinished(self, out_dir: Path, spec: InputFile) -> int:
        """Give every request that has no row yet an expired error row; returns how many requests
        expired, counting those an earlier try wrote before the server stopped."""
        done, expired = set(), 0
        job = OutputPaths.from_option(out_dir)
        for path in job.data_files:
            for row in read_rows(path):
                done.add(row.get("custom_id"))
                expired += (row.get("error") or {}).get("code") == EXPIRED_CODE
        unfinished = [entry.custom_id for entry in spec.entries if entry.custom_id not in done]
        if unfinished:
            errors = JsonlAppender(job.errors)
            try:
                for custom_id in unfinished:
                    errors.write(_expired_row(custom_id))
            finally:
                errors.close()
        return expired + len(unfinished)

    # ---- storage ----------------------------------------------------------------------------------
    def _now(self) -> int:
        return int(self._clock())

    def _past_deadline(self, obj: dict[str, Any]) -> bool:
        return self._clock() >= obj["expires_at"]

    def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        self._update(batch_id, status="failed", failed_at=self._now(), errors={"object": "list", "data": errors})

    def _count_rows(self, batch_id: str) -> tuple[int, int]:
        def rows(path: Path) -> int:
            return path.read_bytes().count(b"\n") if path.exists() else 0
        job = OutputPaths.from_option(self.root / batch_id)
        return rows(job.results), rows(job.errors)

    def _update(self, batch_id: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            path = self.root / f"{batch_id}.json"
            obj = {**json.loads(path.read_text()), **fields}
            self._save(obj)
            return obj

    def _save(self, obj: dict[str, Any]) -> None:
        atomic_write_json(self.root / f"{obj['id']}.json", obj)

    def _all(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in self.root.glob("*.json")]


# Batches written before these fields existed read as if created with them unset.
BATCH_FIELDS_ADDED_LATER: dict[str, Any] = {"model": None, "usage": None, "output_expires_after": None}


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits on `metadata` (MAX_METADATA_*; its types are the route's to check), and text
    that is text: it is sent back on every read of the batch, and a lone surrogate would make each
    of those a 500."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata: at most {MAX_METADATA_KEYS} keys, got {len(metadata)}", param="metadata")
    try:
        check_text({"metadata": metadata})
    except RequestError as exc:
        raise from_value_error(exc) from None
    for key, value in metadata.items():
        where = json_path((key,), root="metadata")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"{where}: a key of {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}",
                              param="metadata")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"{where}: a value of {len(value)} characters; at most {MAX_METADATA_VALUE_CHARS}",
                              param="metadata")


def _check_output_expiry(policy: dict[str, Any] | None) -> None:
    """OpenAI's rules for `output_expires_after`: anchor `created_at`, 1 hour to 30 days."""
    if policy is None:
        return
    if policy.get("anchor") != "created_at":
        raise bad_request(f"output_expires_after.anchor must be 'created_at', got {policy.get('anchor')!r}",
                          param="output_expires_after")
    seconds, (shortest, longest) = policy.get("seconds"), OUTPUT_EXPIRY_SECONDS
    if type(seconds) is not int or not shortest <= seconds <= longest:
        raise bad_request(f"output_expires_after.seconds must be an integer from {shortest} (1 hour) to "
                          f"{longest} (30 days), got {seconds!r}", param="output_expires_after")


def _batch_error(code: str, message: str, line: int | None = None) -> dict[str, Any]:
    """One entry of a failed batch's `errors.data`, in OpenAI's shape."""
    return {"code": code, "message": message, "param": None, "line": line}


def _line_errors(spec: InputFile) -> list[dict[str, Any]]:
    """Why a file with no valid request failed: its bad lines, each by number (the first few)."""
    if not spec.errors:
        return [_batch_error("invalid_file", "no valid request in the input file: the file has no requests")]
    listed = [_batch_error("invalid_input", e.reason, e.line) for e in spec.errors[:MAX_LISTED_LINE_ERRORS]]
    if (more := len(spec.errors) - MAX_LISTED_LINE_ERRORS) > 0:
        listed.append(_batch_error("invalid_input", f"and {more} more bad line(s)"))
    return listed


def _expired_row(custom_id: str) -> dict[str, Any]:
    """OpenAI's error row for a request the completion window closed on, in OpenAI's words."""
    return error_row(custom_id, None, EXPIRED_CODE, EXPIRED_MESSAGE)


def _usage(results: Path) -> dict[str, Any]:
    """OpenAI's batch `usage`: the tokens of every request that has a result."""
    prompt = cached = completion = 0
    for row in read_rows(results):
        p, c, o = usage_of((row.get("response") or {}).get("body"))
        prompt, cached, completion = prompt + p, cached + c, completion + o
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
