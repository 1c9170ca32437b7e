"""`tokenmill run`: crash-safe batch jobs, JSONL in and OpenAI batch output out (see docs/jobs.md)."""

from tokenmill.jobs.runner import JobConfig, run_job
from tokenmill.jobs.spec import BatchRequest, DocumentOptions

__all__ = ["BatchRequest", "DocumentOptions", "JobConfig", "run_job"]
