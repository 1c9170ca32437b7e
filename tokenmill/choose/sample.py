"""The job's rows and the sample every candidate runs: drawn once (seeded), written once, reused.

The sample is a file of its own (`OUT/sample.jsonl`), so that each candidate runs it as a plain
`tokenmill run` job. Row ids must survive the copy: a text line's id is `line-N`, N its line in
the *job*, so text and id-less JSONL rows are written as JSONL with that id spelled out.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from tokenmill.jobs import JobError
from tokenmill.jobs.input import CsvLayout, DocumentOptions, Entry, read_input, write_subset
from tokenmill.jobs.storage import atomic_write_json

SAMPLE_FILE, RECORD_FILE = "sample.jsonl", "choose.json"
RUN_FOLDERS = ("candidates", "judge")  # what --overwrite clears (besides the two files above)


@dataclass(frozen=True)
class JobRows:
    """The job's good rows (bad lines are never sampled) and the byte size of each line, from
    which the whole job's prompt tokens are projected."""

    path: Path
    format: str  # "batch" | "jsonl" | "text" | "csv"
    sha256: str
    entries: list[Entry]
    sizes: dict[str, int]  # custom_id → bytes of its line
    invalid_lines: int
    csv_layout: CsvLayout | None = None  # a CSV job's header

    @property
    def ids(self) -> list[str]:
        return [e.custom_id for e in self.entries]


@dataclass(frozen=True)
class Sample:
    path: Path
    ids: list[str]  # in job order
    reused: bool  # an earlier `choose` in this folder drew it


def read_job(path: Path, input_format: str = "auto", csv_columns: DocumentOptions | None = None) -> JobRows:
    """`csv_columns`: a CSV job's prompt and id columns (DocumentOptions.prompt_column, id_column)."""
    spec = read_input(path, csv_columns or DocumentOptions(), input_format)
    if not spec.entries:
        raise JobError(f"{path}: no valid rows to sample ({len(spec.errors)} bad line(s))")
    sizes = {}
    with path.open("rb") as f:
        for entry in spec.entries:
            f.seek(entry.offset)
            sizes[entry.custom_id] = len(f.readline())
    return JobRows(path, spec.format, spec.sha256, spec.entries, sizes, len(spec.errors), spec.csv_layout)


def draw(ids: list[str], size: int, seed: int) -> list[str]:
    """`size` of `ids` at random (all of them if fewer), in their own order; the same for the same seed."""
    if size < 1:
        raise ValueError(f"--sample must be >= 1, got {size}")
    picked = sorted(random.Random(seed).sample(range(len(ids)), min(size, len(ids))))
    return [ids[i] for i in picked]


def prepare_sample(job: JobRows, eligible: list[str], size: int, seed: int, out: Path, overwrite: bool) -> Sample:
    """Draw the sample and write it under `out`, or reuse the one an earlier run wrote there.

    Refuses to mix: a folder holding a sample of another job, seed or size is an error unless
    `overwrite` (which also clears the candidates' runs: they ran the old sample)."""
    ids = draw(eligible, size, seed)
    record = {"job": str(job.path), "job_sha256": job.sha256, "seed": seed, "size": size,
              "ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()}
    path, record_path = sample_files(out)
    if overwrite:
        _clear(out)
    if record_path.exists() and path.exists():
        old = json.loads(record_path.read_text())
        if old == record:
            return Sample(path, ids, reused=True)
        changed = [k for k in ("job_sha256", "seed", "size", "ids_sha256") if old.get(k) != record[k]]
        raise JobError(f"{out} holds a choose run on another sample ({', '.join(changed)} differ: the job, "
                       "--seed, --sample or the expected ids changed); use another -o, or --overwrite to "
                       "discard it and its candidates' runs")
    out.mkdir(parents=True, exist_ok=True)
    write_subset(job.path, job.format, job.entries, job.csv_layout, set(ids), path)
    atomic_write_json(record_path, record)
    return Sample(path, ids, reused=False)


def sample_files(out: Path) -> tuple[Path, Path]:
    return out / SAMPLE_FILE, out / RECORD_FILE


def _clear(out: Path) -> None:
    for name in RUN_FOLDERS:
        shutil.rmtree(out / name, ignore_errors=True)
    for path in sample_files(out):
        path.unlink(missing_ok=True)
