"""A cascade job from start to end: every row to the first tier, each answer checked, only the
rows whose answer fails the checks on to the next tier; the last tier's answer is kept whatever it is.

Each tier is an ordinary `tokenmill run` job in its own folder, `OUT/tiers/NAME/`, so a tier
killed part way resumes as any job does and no row is answered twice by one tier. Between two
tiers, the hand-on is written whole before the next tier starts:

- `tiers/NAME/rejected.jsonl`: the tier's answers that failed the checks (and its rows that
  failed for good), each with `"rejected": why` — kept for audit;
- `tiers/NAME/final_errors.jsonl`: its rows that failed and cannot go on (a bad input line);
- `tiers/NEXT/input.jsonl`: the rejected rows, ids kept (jobs/input/subset.py), written last: its
  existence says the hand-on is complete.

A tier that finished every row writes `done.json` and is not started again (its model is not even
loaded). When the last tier is done, `OUT/results.jsonl` and `OUT/errors.jsonl` are assembled
from the tiers (every row once, each with a `cascade` field naming its tier and why the earlier
tiers' answers were not kept) and replaced whole, so the assembly too can be cut at any point.
"""

from __future__ import annotations

import contextlib
import gc
import json
import re
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from tokenmill.cascade.summary import CascadeOutcome, TierResult, last_tier_alone
from tokenmill.choose.acceptance import Acceptance, AcceptanceError, acceptance_for
from tokenmill.choose.candidates import Candidate
from tokenmill.choose.runs import log_run, timed
from tokenmill.jobs import JobError, JobFailed, print_summary, run_job, say
from tokenmill.jobs.backends import built_backend
from tokenmill.jobs.input import DocumentOptions, input_identity, read_input, write_subset
from tokenmill.jobs.journal import Footprint, OutputLock, OutputPaths, refuse_inputs_in, with_temporaries
from tokenmill.jobs.results import ErrorCode, is_final, read_rows, usage_of
from tokenmill.jobs.storage import atomic_write_json, replacing

TIERS, CASCADE_FILE, DONE_FILE = "tiers", "cascade.json", "done.json"
REJECTED_FILE, FINAL_ERRORS_FILE, TIER_INPUT = "rejected.jsonl", "final_errors.jsonl", "input.jsonl"


@dataclass
class CascadeConfig:
    input: Path
    output: Path  # a folder
    tiers: list[Candidate]  # cheapest first
    accept: list[str]  # the --accept checks every tier but the last must pass
    input_format: str = "auto"
    csv_columns: DocumentOptions = field(default_factory=DocumentOptions)
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if len(self.tiers) < 2:
            raise JobError(f"a cascade needs at least two --tier (got {len(self.tiers)}): with one, every answer "
                           "is kept whatever it is, which is `tokenmill run`")
        names = [t.name for t in self.tiers]
        if len(set(names)) < len(names):
            raise JobError(f"--tier names must differ: {sorted({n for n in names if names.count(n) > 1})}")


def run_cascade(config: CascadeConfig, console: Console) -> CascadeOutcome:
    """Run (or resume) the cascade. JobError before any work for what cannot run; JobFailed when a
    tier could not finish every row (a re-run resumes); KeyboardInterrupt when stopped."""
    try:
        checks = [acceptance_for(t, config.accept, "--tier") for t in config.tiers[:-1]]
    except AcceptanceError as exc:
        raise JobError(str(exc)) from None
    for acceptance in checks:
        if uncalibrated := [c.text for c in acceptance.checks if c.calibrated]:
            raise JobError(f"--accept {uncalibrated[0]} needs a threshold (e.g. {uncalibrated[0]}>=-1); "
                           "`tokenmill choose` can calibrate one on a labelled sample")
    paths = OutputPaths.from_option(config.output)
    refuse_inputs_in(_footprint(config, paths), {"the input": config.input})
    with OutputLock(paths.lock, config.output):
        _claim(config, paths)
        _run_tiers(config, checks, console)
        return _assemble(config, paths)


def _footprint(config: CascadeConfig, paths: OutputPaths) -> Footprint:
    """What the cascade writes: its own files, and every tier's folder."""
    return Footprint(with_temporaries((*paths.files, config.output / CASCADE_FILE)), (config.output / TIERS,))


def _run_tiers(config: CascadeConfig, checks: list[Acceptance], console: Console) -> None:
    source, fmt = config.input, config.input_format
    for i, tier in enumerate(config.tiers):
        folder = config.output / TIERS / tier.name
        acceptance = checks[i] if i < len(checks) else None
        if (folder / DONE_FILE).exists():
            _check_done(tier, source, folder)
        else:
            _run_tier(tier, source, fmt, folder, acceptance, config, console, first=i == 0)
        if acceptance is not None:
            after = config.output / TIERS / config.tiers[i + 1].name
            if not (after / TIER_INPUT).exists():
                _hand_on(tier.name, source, fmt, folder, acceptance, config, after)
            source, fmt = after / TIER_INPUT, "auto"


def _claim(config: CascadeConfig, paths: OutputPaths) -> None:
    """Record what this folder's cascade is; a folder holding another is refused (or cleared with
    --overwrite), since its tiers' answers would not be this cascade's."""
    record = {"input": str(config.input), "input_identity": input_identity(config.input),
              "tiers": [{"name": t.name, "flags": t.flags_text} for t in config.tiers], "accept": config.accept}
    path = config.output / CASCADE_FILE
    if config.overwrite:
        shutil.rmtree(config.output / TIERS, ignore_errors=True)
        for file in (path, paths.results, paths.errors, paths.summary):
            file.unlink(missing_ok=True)
    if path.exists():
        old = json.loads(path.read_text())
        _check_same_cascade(config.output, {"input_identity": record["input_identity"], **old}, record)
        if "input_identity" in old:
            return  # else recorded before cascades kept their input's identity: the rest decided, now it is kept
    config.output.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)


_RECORDED = {"input": "the input's path", "input_identity": "the input's contents (size, sha256 of its ends)",
             "tiers": "the tiers", "accept": "the --accept checks"}


def _check_same_cascade(output: Path, old: dict[str, Any], record: dict[str, Any]) -> None:
    changed = [_RECORDED[k] for k in record if old.get(k) != record[k]]
    if changed:
        raise JobError(f"{output} holds another cascade ({'; '.join(changed)} differ); use another -o, or "
                       "--overwrite to discard it and its tiers' answers")


def _check_done(tier: Candidate, source: Path, folder: Path) -> None:
    """A finished tier is not run again: only if the rows it finished are still the ones it is given."""
    recorded = json.loads((folder / DONE_FILE).read_text()).get("input_identity")
    if recorded is not None and recorded != input_identity(source):
        raise JobError(f"tier {tier.name} finished on another {source} than the one there now (edited since?); "
                       "use --overwrite to run the cascade again")


def _run_tier(tier: Candidate, source: Path, fmt: str, folder: Path, acceptance: Acceptance | None,
              config: CascadeConfig, console: Console, first: bool) -> None:
    """Run (or resume) one tier's job until every row it was given is final."""
    if not first and not _has_rows(source):  # the tier before accepted every answer
        _write_done(folder, source, 0)
        return
    job = tier.job_config(source, folder, config.progress)
    options = replace(job.options, prompt_column=config.csv_columns.prompt_column,
                      id_column=config.csv_columns.id_column)
    if acceptance is not None and acceptance.logprobs is not None:
        options = replace(options, logprobs=max(acceptance.logprobs, options.logprobs or 0))
    job = replace(job, options=options, input_format=fmt)
    say(console, f"\n[{tier.name}] tokenmill run {tier.flags_text}")
    try:
        with built_backend(tier.backend) as backend:
            outcome = run_job(job, backend, console)
    finally:
        gc.collect()  # the engine's memory goes before the next tier loads its own
    print_summary(outcome, console)
    if outcome.interrupted:
        raise KeyboardInterrupt
    log_run(folder, outcome)
    req = outcome.requests
    if req.not_done or req.retryable:
        raise JobFailed(f"tier {tier.name}: {req.not_done + req.retryable} row(s) not final (retryable failures "
                        "or not done); re-run the same command to resume")
    _write_done(folder, source, req.total)


def _write_done(folder: Path, source: Path, rows: int) -> None:
    atomic_write_json(folder / DONE_FILE, {"rows": rows, "input_identity": input_identity(source)})


def _has_rows(path: Path) -> bool:
    with path.open("rb") as f:
        return any(not line.isspace() for line in f)


def _hand_on(name: str, source: Path, fmt: str, folder: Path, acceptance: Acceptance, config: CascadeConfig,
             after: Path) -> None:
    """Check the tier's answers; write its rejected and final rows, then the next tier's input."""
    paths = OutputPaths.from_option(folder)
    rejected: dict[str, str] = {}
    with _writing(folder / REJECTED_FILE) as audit:
        for row in read_rows(paths.results):
            try:
                reason = acceptance.rejects(row["response"]["body"])
            except AcceptanceError as exc:
                raise JobError(f"--tier {name}: {exc} (its answers are kept in {paths.results})") from None
            if reason is not None:
                rejected[row["custom_id"]] = reason
                audit({**row, "rejected": reason})
        good = read_input(source, config.csv_columns, fmt)
        ids = {e.custom_id for e in good.entries}
        with _writing(folder / FINAL_ERRORS_FILE) as final:
            # A final error is never retried, so its row has no result beside it.
            for row in filter(is_final, read_rows(paths.errors)):
                custom_id = row.get("custom_id")
                # A bad line ends here even where its id is a good line's (a duplicate id): it has
                # no answer for a later tier to improve on.
                if custom_id in ids and row["error"]["code"] != ErrorCode.INVALID_INPUT:
                    rejected[custom_id] = f"failed: {row['error']['code']}"
                    audit({**row, "rejected": rejected[custom_id]})
                else:  # a line no tier can read: it ends here
                    final(row)
    after.mkdir(parents=True, exist_ok=True)
    write_subset(Path(good.path), good.format, good.entries, good.csv_layout, rejected, after / TIER_INPUT)


def _assemble(config: CascadeConfig, paths: OutputPaths) -> CascadeOutcome:
    """OUT/results.jsonl and OUT/errors.jsonl from the tiers, and the summary."""
    escalations: dict[str, list[dict[str, str]]] = {}
    tiers: list[TierResult] = []
    out = config.output
    with _writing(paths.results) as results, _writing(paths.errors) as errors:
        for i, tier in enumerate(config.tiers):
            folder = out / TIERS / tier.name
            last = i == len(config.tiers) - 1
            handed = {} if last else {r["custom_id"]: r["rejected"] for r in read_rows(folder / REJECTED_FILE)}
            result = _tier_result(tier, folder)
            for row in read_rows(OutputPaths.from_option(folder).results):
                result.answered += 1
                prompt, _, completion = usage_of(row["response"]["body"])
                result.prompt_tokens += prompt
                result.completion_tokens += completion
                if row["custom_id"] not in handed:
                    result.accepted += 1
                    results(_tagged(row, tier.name, escalations))
            final = (read_rows(OutputPaths.from_option(folder).errors) if last
                     else read_rows(folder / FINAL_ERRORS_FILE))
            for row in final:
                if not last or is_final(row):
                    result.failed += 1
                    errors(_tagged(row, tier.name, escalations))
            for custom_id, reason in handed.items():
                escalations.setdefault(custom_id, []).append({"tier": tier.name, "reason": reason})
            result.rejections = dict(Counter(_kind(r) for r in handed.values()).most_common())
            result.escalated = len(handed)
            result.usd = (tier.price.cost(result.wall_s, result.prompt_tokens, result.completion_tokens)
                          if result.answered else 0.0)
            tiers.append(result)
    outcome = CascadeOutcome(str(config.input), str(paths.results), str(paths.errors), tiers)
    outcome.last_tier_alone = last_tier_alone(tiers)
    atomic_write_json(paths.summary, outcome.to_json())
    return outcome


def _tier_result(tier: Candidate, folder: Path) -> TierResult:
    done = json.loads((folder / DONE_FILE).read_text()) if (folder / DONE_FILE).exists() else {}
    timing = timed(folder)
    return TierResult(tier.name, tier.flags_text, tier.price.describe(), rows=done.get("rows", 0),
                      wall_s=timing.get("wall_s"))


def _tagged(row: dict[str, Any], tier: str, escalations: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """The row with where it was answered, and why the tiers before did not keep their answers."""
    return {**row, "cascade": {"tier": tier, "rejected_by": escalations.get(row.get("custom_id") or "", [])}}


def _kind(reason: str) -> str:
    """A rejection as a countable kind, its numbers left out: "min-logprob -2.1 < -1" → "min-logprob < -1"."""
    return _MEASURED.sub("", reason)


_MEASURED = re.compile(r" -?\d[\d.e+-]*(?= <)")


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A JSONL file written whole (storage.replacing): yields the function that writes a row."""
    with replacing(path) as f:
        yield lambda row: f.write(orjson.dumps(row) + b"\n")

