"""`tokenmill split`'s work: read the input as `tokenmill run` reads it, write its requests as
`part-00001.jsonl`, `part-00002.jsonl`, … (batch_parts.py cuts them, as the Batch API backend
does), and the lines that cannot be sent to `errors.jsonl`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tokenmill.jobs.backends import OPENAI_MAX_BYTES, OPENAI_MAX_REQUESTS, OpenPart, PartSplitter, check_limits
from tokenmill.jobs.input import DocumentOptions, read_input
from tokenmill.jobs.journal import Footprint, OutputLock, refuse_inputs_in
from tokenmill.jobs.results import ErrorCode, error_row
from tokenmill.openai_compat import new_id

PART_NAME = "part-{:05d}.jsonl"
ERRORS_NAME = "errors.jsonl"
MAX_LISTED_ERRORS = 20
OPEN_PREFIX = ".open-"  # a part still being written: renamed to its part name once full


@dataclass(frozen=True)
class WrittenPart:
    path: Path
    url: str  # the endpoint to create its batch with
    requests: int
    bytes: int


@dataclass
class SplitOutcome:
    parts: list[WrittenPart] = field(default_factory=list)
    bad_lines: int = 0
    first_errors: list[str] = field(default_factory=list)  # the first bad lines' messages, in line order
    errors_path: Path | None = None  # None when every line went into a part


def split_input(
    input_path: Path, out_dir: Path, options: DocumentOptions, input_format: str = "auto",
    max_requests: int = OPENAI_MAX_REQUESTS, max_bytes: int = OPENAI_MAX_BYTES, overwrite: bool = False,
    on_part: Callable[[WrittenPart], None] | None = None,
) -> SplitOutcome:
    """Cut the input into Batch API files in `out_dir`; `on_part` hears of each as it is written.
    ValueError for a limit that is not positive, or an `out_dir` that holds parts already."""
    check_limits(max_requests, max_bytes, "max_requests", "max_bytes")
    refuse_inputs_in(_footprint(out_dir), {"the input": input_path})
    out_dir.mkdir(parents=True, exist_ok=True)
    with OutputLock(out_dir, out_dir):  # the folder itself: nothing but parts may lie in it
        return _split(input_path, out_dir, options, input_format, max_requests, max_bytes, overwrite, on_part)


def _footprint(out_dir: Path) -> Footprint:
    """The files a split writes, or replaces with --overwrite: any part, not only those it will write."""
    return Footprint((*out_dir.glob("part-*.jsonl"), *out_dir.glob(OPEN_PREFIX + "*"), out_dir / ERRORS_NAME))


def _split(
    input_path: Path, out_dir: Path, options: DocumentOptions, input_format: str, max_requests: int, max_bytes: int,
    overwrite: bool, on_part: Callable[[WrittenPart], None] | None,
) -> SplitOutcome:
    spec = read_input(input_path, options, input_format)  # every line checked first, as `run` checks it
    _claim(out_dir, overwrite)
    outcome = SplitOutcome()
    errors = [(e.line, error_row(e.custom_id, e.line, ErrorCode.INVALID_INPUT, e.reason)) for e in spec.errors]
    splitter = PartSplitter(max_requests, max_bytes, lambda url: _open_part(out_dir),
                            lambda part: _finish_part(part, out_dir, outcome, on_part), bytes_flag="--max-bytes")
    try:
        for request in spec.requests(spec.entries):
            if (problem := splitter.add(request)) is not None:
                row = error_row(request.custom_id, request.line, ErrorCode.INVALID_INPUT, problem)
                errors.append((request.line, row))
        splitter.finish()
    finally:
        splitter.drop()
        for stale in out_dir.glob(OPEN_PREFIX + "*"):  # only there if something above raised
            stale.unlink()
    if errors:
        outcome.bad_lines, outcome.errors_path = len(errors), out_dir / ERRORS_NAME
        errors.sort(key=lambda e: e[0])
        outcome.errors_path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for _, row in errors))
        outcome.first_errors = [row["error"]["message"] for _, row in errors[:MAX_LISTED_ERRORS]]
    return outcome


def _claim(out_dir: Path, overwrite: bool) -> None:
    """Parts of an earlier split beside the new ones would be uploaded as one job: refused, or
    removed with --overwrite."""
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = sorted(out_dir.glob("part-*.jsonl")) + [p for p in [out_dir / ERRORS_NAME] if p.exists()]
    if earlier and not overwrite:
        raise ValueError(f"{out_dir} already holds {earlier[0].name} (from an earlier split): choose another "
                         "-o, or add --overwrite to replace its files")
    for path in earlier:
        path.unlink()


def _open_part(out_dir: Path) -> IO[bytes]:
    return (out_dir / f"{OPEN_PREFIX}{new_id('')}.jsonl").open("xb")  # closed by _finish_part, or by drop()


def _finish_part(part: OpenPart, out_dir: Path, outcome: SplitOutcome,
                 on_part: Callable[[WrittenPart], None] | None) -> None:
    part.file.close()
    path = out_dir / PART_NAME.format(len(outcome.parts) + 1)  # numbered in the order they fill
    os.replace(part.file.name, path)
    written = WrittenPart(path, part.url, part.count, part.bytes)
    outcome.parts.append(written)
    if on_part is not None:
        on_part(written)
