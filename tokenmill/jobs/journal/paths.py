"""Where a job's files are: the one place their names are written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# A folder output's files (`-o out/`); a URL output's small files have the same names.
RESULTS_FILE, ERRORS_FILE, SUMMARY_FILE, JOB_FILE = "results.jsonl", "errors.jsonl", "summary.json", "job.json"
BACKEND_FILE, INDEX_FILE = "backend.json", "results.index"


@dataclass(frozen=True)
class OutputPaths:
    results: Path
    errors: Path
    summary: Path
    job: Path
    backend_state: Path  # a backend's own state (KeepsState), e.g. the Batch API's batch ids
    index: Path  # the done-index of the results file

    @classmethod
    def from_option(cls, output: Path, errors: Path | None = None) -> OutputPaths:
        """`-o out/` → out/results.jsonl, errors.jsonl, summary.json, job.json;
        `-o res.jsonl` → res.jsonl, res.errors.jsonl, res.summary.json, res.job.json (and the
        done-index, results.index / res.index; backend.json / res.backend.json where a backend
        keeps state)."""
        if output.suffix == ".jsonl":
            stem = output.with_suffix("")
            default_errors = Path(f"{stem}.errors.jsonl")
            return cls(output, errors or default_errors, Path(f"{stem}.summary.json"), Path(f"{stem}.job.json"),
                       Path(f"{stem}.backend.json"), Path(f"{stem}.index"))
        return cls(output / RESULTS_FILE, errors or output / ERRORS_FILE, output / SUMMARY_FILE, output / JOB_FILE,
                   output / BACKEND_FILE, output / INDEX_FILE)

    @property
    def data_files(self) -> tuple[Path, Path]:
        return self.results, self.errors

    @property
    def lock(self) -> Path:
        """Held while a run writes these files (guard.OutputLock): `results.lock`, `res.lock`."""
        return self.results.with_suffix(".lock")

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file a job writes here."""
        return (*self.data_files, self.summary, self.job, self.backend_state, self.index, self.lock)

