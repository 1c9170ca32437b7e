"""A job's identity (job.json): its input and the settings that change results, so a re-run with
another input or options refuses instead of mixing two jobs in one output."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from tokenmill.jobs.errors import JobError
from tokenmill.jobs.journal.paths import OutputPaths
from tokenmill.jobs.storage import Location, atomic_write_json

# The layout of a job's files. 3: an error row's input line is `error.line` (2 kept it only in the
# message, so a re-run of a version-2 job would not know its failed lines, and would pay for them again).
JOB_VERSION = 3


# ---- the job's identity --------------------------------------------------------------------------
def job_record(input_path: Location, identity: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """What job.json holds: the input's identity (spec.input_identity) and the settings that
    change results."""
    canonical = json.dumps({"input": identity, "settings": settings}, sort_keys=True)
    return {
        "version": JOB_VERSION,
        "fingerprint": hashlib.sha256(canonical.encode()).hexdigest(),
        "input": str(input_path),
        "input_identity": identity,
        "settings": settings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def claim_outputs(paths: OutputPaths, job: dict[str, Any], overwrite: bool) -> bool:
    """Make the output files this job's. Returns True when resuming an earlier run of it.

    Refuses (JobError) when they belong to a different job, or to none we know of.
    """
    if overwrite:
        for path in (*paths.data_files, paths.summary, paths.job, paths.backend_state, paths.index):
            path.unlink(missing_ok=True)
    existing = [p for p in paths.data_files if p.exists() and p.stat().st_size > 0]
    if paths.job.exists():
        check_same_job(paths.job.read_bytes(), job, str(paths.job), str(paths.results))
        return True
    if existing:
        raise JobError(
            f"{existing[0]} already exists but has no {paths.job.name} beside it, so it was not started by "
            "this job; choose another -o, or add --overwrite to replace it"
        )
    paths.job.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(paths.job, job)
    return False


def check_same_job(recorded: bytes, job: dict[str, Any], where: str, results: str) -> None:
    """Refuse (JobError) when the job.json `recorded` (read from `where`) is another job's than
    `job`: `results` names the output in the message."""
    try:
        old = json.loads(recorded)
    except ValueError as exc:
        raise JobError(f"{where} is not valid JSON ({exc}); use --overwrite to start over") from None
    if old.get("version") != JOB_VERSION:
        raise JobError(
            f"{results} was written by another version of tokenmill (job format {old.get('version')}; this one "
            f"reads {JOB_VERSION}): finish it with the tokenmill that began it, or add --overwrite to start over"
        )
    if old.get("fingerprint") != job["fingerprint"]:
        raise JobError(_mismatch_message(results, old, job))


def _setting(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _mismatch_message(results: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    reasons = []
    if old.get("input_identity") != new["input_identity"]:
        was, now = old["input_identity"], new["input_identity"]
        reasons.append(
            f"the input differs (it was {old.get('input')!r}, {was.get('size')} bytes, ends sha256 "
            f"{str(was.get('ends_sha256'))[:12]}…; now {new['input']!r}, {now['size']} bytes, "
            f"ends sha256 {now['ends_sha256'][:12]}…)"
        )
    old_settings, new_settings = old.get("settings") or {}, new["settings"]
    for key in sorted(old_settings.keys() | new_settings.keys()):
        if old_settings.get(key) != new_settings.get(key):
            reasons.append(f"{key} was {_setting(old_settings.get(key))}, now {_setting(new_settings.get(key))}")
    return (
        f"{results} belongs to a different job: {'; '.join(reasons) or 'its fingerprint differs'}. "
        "Re-run with the original input and options to resume it, choose another -o, "
        "or add --overwrite to discard it"
    )

