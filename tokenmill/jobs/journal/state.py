"""What earlier runs of a job left in its files, read back when it starts again."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.jobs.journal.files import parse_row, repair_jsonl, rewrite_jsonl
from tokenmill.jobs.journal.index import (
    ENDED_BY_LENGTH,
    INDEX_RECORD,
    MAX_TOKENS_DEFAULTED,
    STRUCTURED,
    create_index,
    read_index,
)
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.rows import ErrorCode, finish_reason_of, is_final, line_of


@dataclass
class OutputState:
    """What earlier runs of this job left in the output files, as a re-run needs it: which input
    lines are finished, and the counts the summary adds to this run's."""

    done_lines: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # [line]: has a result (index)
    done: int = 0  # rows with a result
    structured: int = 0  # … of those, asking for a structured output
    structured_cut: int = 0  # … and answered but ended by max_tokens
    max_tokens_defaulted: int = 0  # … done rows that gave no max_tokens
    # Results the done-index does not describe (it was lost, or did not match and was rebuilt): by
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
    return [row for line in io.BytesIO(data) if (row := parse_row(line)) is not None]


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
        if (row.get("error") or {}).get("code") == ErrorCode.INVALID_INPUT:
            state.invalid_lines.add(line)
        elif not state.finished(line) and row.get("custom_id") not in state.unindexed:
            state.failed_lines.add(line)  # read again as the input is (its id is taken then), not run

