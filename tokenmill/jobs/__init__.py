"""`tokenmill run`: crash-safe batch jobs, JSONL in and OpenAI batch output out (docs/jobs.md).

Layers, each importing only those before it (docs/layout.md): `storage` and `errors` (where
files are; what stops a job) → `input/` (reading the input) → `journal/` (the job's files) →
`backends/` (what serves the requests) → the job itself (`config`, `work`, `runner`, `summary`,
`progress`, `flags`, `cli`). Other packages use what this module, `input`, `journal`,
`backends`, `results`, `flags` and `storage` export, never the modules behind them.
"""

from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import ExitCode, JobError, JobFailed
from tokenmill.jobs.progress import say
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.summary import JobOutcome, print_summary

__all__ = ["ExitCode", "JobConfig", "JobError", "JobFailed", "JobOutcome", "print_summary", "run_job", "say"]
