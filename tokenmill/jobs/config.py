"""What a job is asked to do: its input, output and the choices that are not the backend's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.jobs import storage
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.journal.parts import PART_ROWS, OutputLayout
from tokenmill.jobs.storage import Location

ORDERS = ("input", "length-buckets")
OUTPUT_FORMATS = ("jsonl", "parquet")


@dataclass
class JobConfig:
    input: Location  # a local Path, or a URL (a str with "://": storage.py)
    output: Location  # a folder or a results .jsonl file; a URL is a folder
    options: DocumentOptions = field(default_factory=DocumentOptions)
    errors: Path | None = None
    input_format: str = "auto"
    strict: bool = False
    overwrite: bool = False
    order: str = "input"
    price_per_hour: float | None = None
    progress: bool = True
    fsync_interval: float = 1.0
    output_format: str = "jsonl"  # the committed parts' format (a URL output, or parquet)
    part_rows: int = PART_ROWS
    spool_dir: Path | None = None  # a URL output's local journal (default: under the cache folder)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"--order must be one of {ORDERS}, got {self.order!r}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {self.price_per_hour}")
        if self.output_format not in OUTPUT_FORMATS:
            raise ValueError(f"--output-format must be one of {OUTPUT_FORMATS}, got {self.output_format!r}")
        if self.part_rows < 1:
            raise ValueError(f"--part-rows must be at least 1, got {self.part_rows}")
        self._check_output()

    def _check_output(self) -> None:
        storage.check(self.input)  # a protocol without its package: refused before any work
        storage.check(self.output)
        remote = storage.is_url(self.output)
        if storage.suffix(self.output) == ".jsonl" and (remote or self.output_format == "parquet"):
            raise ValueError(f"-o {self.output}: "
                             + ("a URL output is a folder" if remote else "--output-format parquet writes a folder")
                             + " (results/ parts, errors.jsonl, summary.json, job.json in it): name a folder")
        if remote and self.errors is not None:
            raise ValueError("--errors with a URL -o: errors.jsonl goes beside the results on the object store")
        if self.spool_dir is not None and not remote:
            raise ValueError("--spool-dir is where a URL -o keeps its local journal; a local -o is its own")

    def check_paths(self) -> None:
        """Refuse, before any work, paths the job could not use: an input that is missing, a folder
        or unreadable; an output, --errors or --spool-dir where a file is in the way of a folder (or
        a folder in the way of a file) or that cannot be written to. environment.PathError names
        the flag. Not in __post_init__: `tokenmill choose` builds its candidates' jobs on stand-in
        paths and checks its own."""
        storage.check_input(self.input)
        local_file = not storage.is_url(self.output) and storage.suffix(self.output) == ".jsonl"
        storage.check_output(self.output, "-o", is_file=local_file)
        if self.errors is not None:
            storage.check_output(self.errors, "--errors", is_file=True)
        if self.spool_dir is not None:
            storage.check_output(self.spool_dir, "--spool-dir")

    @property
    def layout(self) -> OutputLayout:
        return OutputLayout(self.output, self.errors, self.output_format, self.part_rows, self.spool_dir)

    def output_fingerprint(self) -> dict[str, Any]:
        """The output settings that change the files (only when set: older jobs still resume)."""
        return {"output_format": self.output_format} if self.output_format != "jsonl" else {}
