"""``tokenmill run``: flags → `JobConfig` and `BackendSpec` (flags.py) → backend → `run_job` →
`JobOutcome`, printed here with the exit code. The work is in runner.py and the backends."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.console import Console

from tokenmill.environment import PathError
from tokenmill.jobs.errors import ExitCode, JobError, JobFailed
from tokenmill.jobs.flags import add_arguments, parse_job
from tokenmill.jobs.progress import say

if TYPE_CHECKING:
    from tokenmill.jobs.summary import JobOutcome

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    from tokenmill.jobs.backends.base import BackendUnavailable
    from tokenmill.jobs.backends.build import built_backend
    from tokenmill.jobs.runner import run_job
    from tokenmill.jobs.summary import print_summary

    console = Console(stderr=True)
    try:
        job, spec = parse_job(args)
        job.check_paths()
        with built_backend(spec) as backend:
            outcome = run_job(job, backend, console)
    except JobFailed as exc:
        print(f"tokenmill run: {exc}", file=sys.stderr)
        return ExitCode.JOB_FAILED
    # FileNotFoundError: an input that is not there (an object store's: local ones are checked first)
    except (JobError, BackendUnavailable, PathError, FileNotFoundError) as exc:
        print(f"tokenmill run: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except OSError as exc:  # mid-job: a full disk, a folder gone or made read-only under the job
        print(f"tokenmill run: stopped: {_os_error(exc)}. The results so far are kept: make room (or fix the "
              "folder) and re-run the same command to resume", file=sys.stderr)
        return ExitCode.JOB_FAILED
    except KeyboardInterrupt:  # before the work started (validation); nothing to resume yet
        print("tokenmill run: interrupted before any request ran", file=sys.stderr)
        return ExitCode.INTERRUPTED
    print_summary(outcome, Console())
    return finish(outcome, console)


def finish(outcome: JobOutcome, console: Console) -> int:
    """What the user does next, and the exit code."""
    req = outcome.requests
    if outcome.interrupted:
        say(console, f"interrupted: {req.not_done} request(s) not done. Re-run the same command to resume; "
                      f"the {req.done} result(s) so far are kept in {outcome.results_path}")
        return ExitCode.INTERRUPTED
    if req.retryable:
        say(console, f"{req.retryable} request(s) failed after retries (rate limits, server errors, "
                      "timeouts); re-run the same command to try them again")
    if req.failed:
        say(console, f"{req.failed} request(s) failed: see {outcome.errors_path}")
        return ExitCode.FAILED
    return ExitCode.OK


def _os_error(exc: OSError) -> str:
    """`[Errno 28] No space left on device: 'out/results.jsonl'` in words."""
    reason = (exc.strerror or str(exc)).lower()
    return f"cannot write {exc.filename}: {reason}" if exc.filename else reason

