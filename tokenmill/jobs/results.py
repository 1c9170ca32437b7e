"""A job's rows as the commands built on `run` read them (choose, cascade, the server's Batch API):
what a finished or partial job answered, what failed for good, and what a response body says.

Read-only: a torn last line (a job killed while writing) is not a row, and is left for the job's
own next run to repair.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenmill.jobs.journal.files import parse_row
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.journal.rows import ErrorCode, answer_of, error_row, finish_reason_of, is_final, usage_of

__all__ = ["ErrorCode", "answer_of", "error_row", "final_error_rows", "finish_reason_of", "is_final", "read_rows",
           "result_rows", "usage_of"]


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """A JSONL file's rows, one at a time."""
    if not path.exists():
        return
    with path.open("rb") as f:
        yield from filter(None, map(parse_row, f))


def result_rows(output: Path) -> Iterator[dict[str, Any]]:
    """The result rows of the job whose `-o` was `output`."""
    return read_rows(OutputPaths.from_option(output).results)


def final_error_rows(output: Path) -> Iterator[dict[str, Any]]:
    """… and its error rows that a re-run would not retry."""
    return filter(is_final, read_rows(OutputPaths.from_option(output).errors))
