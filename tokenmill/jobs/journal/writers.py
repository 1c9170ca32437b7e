"""Where a job's rows go: the results with their done-index records, and the errors file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenmill.jobs.journal.files import Appender
from tokenmill.jobs.journal.index import INDEX_HEADER, INDEX_RECORD, IndexEntry
from tokenmill.jobs.journal.rows import encode_row


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


class JsonlAppender(Appender):
    """Rows, a line each (the errors file; the server's Batch API files)."""

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None:
        self.write_bytes(encode_row(row))
        if self.due():
            self.sync()


class RowWriter(Protocol):
    """Where a `ResultSink` puts rows: the job's files, or a list on a Ray replica. `entry` comes
    with every result row (the done-index's record of it)."""

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None: ...
