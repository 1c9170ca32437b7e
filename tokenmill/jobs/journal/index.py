"""The done-index beside the results: a fixed-size record per result row, so a re-run knows what
is done without reading the rows (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from tokenmill.jobs.input.seen_ids import id_key
from tokenmill.jobs.journal.files import parse_row, truncate
from tokenmill.jobs.journal.rows import finish_reason_of
from tokenmill.jobs.storage import atomic_write

# The done-index: a header (magic, and the results file's length when the index began: rows
# before it come from a version without one), then a record per result row, in row order.
INDEX_MAGIC = b"TMIDX001"


INDEX_HEADER = 16


INDEX_RECORD = np.dtype([("line", "<u4"), ("flags", "<u4"), ("key", "<i8"), ("end", "<u8")])


# Record flags: what the summary counts of rows done in earlier runs, without reading them.
STRUCTURED, ENDED_BY_LENGTH, MAX_TOKENS_DEFAULTED = 1, 2, 4


INDEX_CHECKS = 32  # records read back against their rows on every start (_matches_results)


@dataclass(frozen=True)
class IndexEntry:
    """What the done-index records of a result row (`INDEX_RECORD`)."""

    line: int
    key: int  # seen_ids.id_key(custom_id)
    flags: int  # STRUCTURED | ENDED_BY_LENGTH | MAX_TOKENS_DEFAULTED


def index_flags(structured: bool, max_tokens_defaulted: bool, body: dict[str, Any] | None) -> int:
    ended = finish_reason_of(body) == "length"
    return STRUCTURED * structured | MAX_TOKENS_DEFAULTED * max_tokens_defaulted | ENDED_BY_LENGTH * ended


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
        truncate(index, INDEX_HEADER + kept * INDEX_RECORD.itemsize)  # records whose rows never made it
    end = int(records["end"][kept - 1]) if kept else base
    if size > end:
        truncate(results, end)
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
            if line.endswith(b"\n") and parse_row(line) is not None:
                return None
    return kept


def _row_matches(f: IO[bytes], records: np.ndarray, base: int, i: int) -> bool:
    """Whether record `i`'s bytes in the results are a row with its custom_id."""
    start = int(records["end"][i - 1]) if i else base
    f.seek(start)
    row = parse_row(f.read(int(records["end"][i]) - start))
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
    atomic_write(index, INDEX_MAGIC + base.to_bytes(8, "little"))


def read_index_records(index: Path, first: int, last: int) -> np.ndarray:
    """Records `first` to `last` (not included) of a done-index, read from the file."""
    with index.open("rb") as f:
        f.seek(INDEX_HEADER + first * INDEX_RECORD.itemsize)
        return np.fromfile(f, INDEX_RECORD, last - first)


