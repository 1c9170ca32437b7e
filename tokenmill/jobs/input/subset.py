"""Some of a job's rows, written as a job of their own that keeps each row's custom_id: the
sample `tokenmill choose` runs its candidates on, the rows a cascade tier hands to the next.

A text line's id is `line-N`, N its line in the *original* file, and an id-less JSONL row's too:
in the new file those rows are written as JSONL with the id spelled out (a CSV row as its id and
prompt), so the same row has the same id in every job it passes through.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable
from pathlib import Path
from typing import BinaryIO

from tokenmill.jobs.input.reader import CsvLayout, decode_line, json_object_line
from tokenmill.jobs.input.request import Entry
from tokenmill.jobs.storage import replacing


def write_subset(source: Path, fmt: str, entries: Iterable[Entry], csv_layout: CsvLayout | None,
                 ids: Container[str], path: Path) -> int:
    """The rows of `source` (read as `fmt`, its good rows `entries`) whose custom_id is in `ids`,
    in the source's order, written whole to `path` (a temporary file renamed: a kill leaves the
    old file or the new one). Returns the rows written."""
    written = 0
    with source.open("rb") as src, replacing(path) as dst:
        for entry in entries:
            if entry.custom_id in ids:
                src.seek(entry.offset)
                dst.write(_line_keeping_id(src, entry, fmt, csv_layout))
                written += 1
    return written


def _line_keeping_id(src: BinaryIO, entry: Entry, fmt: str, csv_layout: CsvLayout | None) -> bytes:
    """The row that starts where `src` stands, as a line that keeps its id (its line number in the
    source is lost)."""
    if csv_layout is not None:
        record = csv_layout.read_record(src)
        row = {"id": entry.custom_id, "prompt": csv_layout.prompt_of(record)}
        return (json.dumps(row, ensure_ascii=False) + "\n").encode()
    raw = src.readline()
    if fmt == "batch":
        return raw if raw.endswith(b"\n") else raw + b"\n"
    if fmt == "text":
        row = {"id": entry.custom_id, "prompt": decode_line(raw, entry.line).strip()}
    else:
        row = {**json_object_line(raw, entry.line), "id": entry.custom_id}
    return (json.dumps(row, ensure_ascii=False) + "\n").encode()
