"""Cutting a job's requests into Batch API input files ("parts") within the API's limits.

OpenAI takes at most 50,000 requests and 200 MB in one batch input file, and a batch has one
endpoint, so every part holds requests of one url only. A part is cut *before* a line would take
it over either limit, so no line is ever split; a single line over the byte limit cannot be sent
at all and is refused on its own. Used by the Batch API backend (batch_api.py) and by
`tokenmill split` (split/), so a part is the same file either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from tokenmill.jobs.input.request import BatchRequest
from tokenmill.settings import SettingError

OPENAI_MAX_REQUESTS = 50_000  # requests in one batch input file
OPENAI_MAX_BYTES = 200 * 1024 * 1024  # bytes in one batch input file


def check_limits(max_requests: int, max_bytes: int, requests_field: str, bytes_field: str) -> None:
    """SettingError naming the field for a limit that is not positive."""
    for name, value in ((requests_field, max_requests), (bytes_field, max_bytes)):
        if value <= 0:
            raise SettingError(f"{{{name}}} must be positive, got {{got}}", got=value)


def too_big(line: bytes, max_bytes: int, bytes_flag: str) -> str | None:
    """Why a batch line cannot go in any part (None when it fits)."""
    if len(line) <= max_bytes:
        return None
    return f"{len(line):,} bytes as a Batch API line, over the {max_bytes:,}-byte limit of one input file " \
        f"({bytes_flag})"


def batch_line(request: BatchRequest) -> bytes:
    """The request as one OpenAI batch input line, compact, newline included (the file's size is
    what the byte limit counts)."""
    obj = {"custom_id": request.custom_id, "method": "POST", "url": request.url, "body": request.body}
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (a "\ud800" escape in the input) has no UTF-8: keep it escaped
        return (json.dumps(obj, separators=(",", ":")) + "\n").encode("ascii")


@dataclass
class OpenPart:
    """A part being filled: its lines are written to `file` as they come."""

    url: str
    file: IO[bytes]
    lines: list[int] = field(default_factory=list)  # input line numbers, in the order written
    requests: list[BatchRequest] = field(default_factory=list)  # only when the splitter keeps them
    bytes: int = 0

    @property
    def count(self) -> int:
        return len(self.lines)


class PartSplitter:
    """Feeds requests into parts, one open part per url, and hands each full part to `on_full`
    (and every part still open to it at `finish`), in the order they fill.

    `open_file(url)` gives the file a new part is written to; `keep_requests` keeps each part's
    requests on it (the backend needs them to merge the part's results), else only line numbers.
    """

    def __init__(self, max_requests: int, max_bytes: int, open_file: Callable[[str], IO[bytes]],
                 on_full: Callable[[OpenPart], None], keep_requests: bool = False,
                 bytes_flag: str = "--max-bytes-per-part") -> None:
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self._open_file, self._on_full, self._keep = open_file, on_full, keep_requests
        self._bytes_flag = bytes_flag
        self._open: dict[str, OpenPart] = {}  # url -> its part being filled (insertion order: opened first)

    def add(self, request: BatchRequest) -> str | None:
        """Put the request in its url's part; returns why it cannot go in one (a line too big), else None."""
        line = batch_line(request)
        if (problem := too_big(line, self.max_bytes, self._bytes_flag)) is not None:
            return problem
        part = self._open.get(request.url)
        if part is not None and part.bytes + len(line) > self.max_bytes:
            self._close(part)  # cut before this line: it starts the next part
            part = None
        if part is None:
            part = self._open[request.url] = OpenPart(request.url, self._open_file(request.url))
        part.file.write(line)
        part.lines.append(request.line)
        part.bytes += len(line)
        if self._keep:
            part.requests.append(request)
        if part.count >= self.max_requests:
            self._close(part)  # full: handed on now, not when the next line comes (it may never)
        return None

    def finish(self) -> None:
        """Hand on every part still open (the input is over)."""
        for part in list(self._open.values()):
            self._close(part)

    def drop(self) -> None:
        """Close the files of the parts still open, handing none on (the job stopped mid-way)."""
        for part in self._open.values():
            part.file.close()
        self._open.clear()

    def _close(self, part: OpenPart) -> None:
        del self._open[part.url]
        self._on_full(part)
