"""Writing the journal's files so that a kill never loses a whole row, and reading them back: appends
of one `write` each, torn-tail repair, atomic replacement."""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tokenmill.jobs.errors import JobError
from tokenmill.jobs.journal.rows import encode_row
from tokenmill.jobs.storage import atomic_write


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
        row = parse_row(line)
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
        truncate(path, start + good_end)
    return rows, len(data) - good_end


def truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)
        os.fsync(f.fileno())


def parse_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace a file's rows atomically (a crash leaves the old file or the new one)."""
    atomic_write(path, b"".join(encode_row(r) for r in rows))


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
