"""What stops a job: the errors every layer of jobs/ raises and the command line turns into an exit code."""

from __future__ import annotations

from enum import IntEnum


class JobError(ValueError):
    """The job cannot start (or go on) as asked; the message says why and what to do."""


class JobFailed(JobError):
    """The job started but cannot go on (a Ray cluster stopped making progress, an endpoint stayed
    down past --retry-for); the rows written so far are kept, and re-running the same command resumes."""


class ExitCode(IntEnum):
    """What `tokenmill run` and the commands built on it (cascade, choose) exit with."""

    OK = 0
    FAILED = 1  # finished, but some rows failed for good (choose: not every candidate finished)
    BAD_INPUT = 2  # refused before any work: the message says what to change
    JOB_FAILED = 3  # started, then could not go on (Ray stalled, endpoint down past --retry-for); re-run resumes
    INTERRUPTED = 130  # Ctrl-C, as a shell reports a SIGINT
