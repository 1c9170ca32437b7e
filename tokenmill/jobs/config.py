"""What a job is asked to do: its input, output and the choices that are not the backend's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.jobs import storage
from tokenmill.jobs.input.reader import FORMATS
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.journal.parts import PART_ROWS, OutputLayout
from tokenmill.jobs.storage import Location
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg
from tokenmill.settings import SettingError, setting

ORDERS = ("input", "length-buckets")
OUTPUT_FORMATS = ("jsonl", "parquet")


@dataclass
class JobConfig:
    input: Location  # a local Path, or a URL (a str with "://": storage.py)
    output: Location  # a folder or a results .jsonl file; a URL is a folder
    options: DocumentOptions = field(default_factory=DocumentOptions)
    errors: Path | None = setting(None, "errors JSONL (default: beside the results)")
    input_format: str = setting("auto", "auto: by suffix and first line", FORMATS)
    strict: bool = setting(False, "refuse the whole job if any line is bad")
    overwrite: bool = setting(False, "discard existing output files and start over")
    order: str = setting("input", "input order, or the biggest requests first, in length buckets (see "
                         "docs/jobs.md)", ORDERS)
    price_per_hour: float | None = setting(None, f"for the cost in the summary: {PRICE_HELP}",
                                           parse=price_per_hour_arg)
    progress: bool = setting(True, "a live progress bar")
    fsync_interval: float = 1.0
    output_format: str = setting(
        "jsonl", "the results as committed parts OUT/results/part-*.jsonl or .parquet (one column per field; a "
        "local -o keeps OUT/results.jsonl as the journal); errors stay JSONL", OUTPUT_FORMATS)
    part_rows: int = setting(PART_ROWS, "a URL -o or parquet: commit a part every N result rows, and at the end "
                             "of each run (at most N rows are redone after a lost machine)", metavar="N")
    spool_dir: Path | None = setting(None, "a URL -o: the local journal it is committed from (default: "
                                     "$TOKENMILL_CACHE/jobs/<hash of the URL>)", metavar="DIR")

    def __post_init__(self) -> None:
        for name, allowed in (("order", ORDERS), ("output_format", OUTPUT_FORMATS)):
            if getattr(self, name) not in allowed:
                raise SettingError(f"{{{name}}} must be one of {{allowed}}, got {{got!r}}", allowed=allowed,
                                   got=getattr(self, name))
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise SettingError("{price_per_hour} must be >= 0, got {got}", got=self.price_per_hour)
        if self.part_rows < 1:
            raise SettingError("{part_rows} must be at least 1, got {got}", got=self.part_rows)
        self._check_output()

    def _check_output(self) -> None:
        storage.check(self.input)  # a protocol without its package: refused before any work
        storage.check(self.output)
        remote = storage.is_url(self.output)
        if storage.suffix(self.output) == ".jsonl" and (remote or self.output_format == "parquet"):
            raise SettingError("{output} {got}: " + ("a URL output is a folder" if remote
                                                     else "{output_format} parquet writes a folder")
                               + " (results/ parts, errors.jsonl, summary.json, job.json in it): name a folder",
                               got=self.output)
        if remote and self.errors is not None:
            raise SettingError("{errors} with a URL {output}: errors.jsonl goes beside the results on the object "
                               "store")
        if self.spool_dir is not None and not remote:
            raise SettingError("{spool_dir} is where a URL {output} keeps its local journal; a local one is its own")

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
