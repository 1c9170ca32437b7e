"""`tokenmill run`: crash-safe batch jobs, JSONL in and OpenAI batch output out (see docs/jobs.md)."""

from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.spec import BatchRequest, DocumentOptions

__all__ = ["BatchRequest", "DocumentOptions", "JobConfig", "run_job"]
