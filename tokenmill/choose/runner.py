"""`tokenmill choose` from start to end: sample the job, run each candidate on it as a `tokenmill
run` job, score the answers, measure and project, decide.

Candidates run one after another (side by side they would share the machine and each measure
the other's load). Each has its own folder, `OUT/candidates/NAME/`, holding an ordinary job's
files, so a re-run resumes the one that was cut off and finds the others done. Speeds come from
the job summaries of the runs that finished (`runs.jsonl` beside them): a run killed before its
summary leaves rows that are scored but not timed.
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from tokenmill.choose.acceptance import acceptance_for
from tokenmill.choose.candidates import Candidate
from tokenmill.choose.cascades import CascadeSpec, TierEvidence, evaluate
from tokenmill.choose.expected import compare_ids, read_expected
from tokenmill.choose.judge_job import JudgeConfig, judge_scores
from tokenmill.choose.report import report_files, write_reports
from tokenmill.choose.results import DONE, FAILED, INCOMPLETE, CandidateResult, ChooseReport, Projection
from tokenmill.choose.runs import log_run, projected_wall, timed
from tokenmill.choose.sample import RUN_FOLDERS, JobRows, Sample, prepare_sample, read_job, sample_files
from tokenmill.choose.scorers import DEFAULT_SCORER, Score, make_scorer
from tokenmill.choose.stats import decide, quality
from tokenmill.cost import MILLION
from tokenmill.jobs import JobError, JobFailed, JobOutcome, print_summary, run_job, say
from tokenmill.jobs.backends import EndpointBackend, built_backend
from tokenmill.jobs.input import DocumentOptions, read_input
from tokenmill.jobs.journal import Footprint, OutputLock, OutputPaths, refuse_inputs_in, with_temporaries
from tokenmill.jobs.results import answer_of, final_error_rows, result_rows, usage_of
from tokenmill.jobs.storage import atomic_write_json

CANDIDATES, CANDIDATE_FILE = "candidates", "candidate.json"


@dataclass
class ChooseConfig:
    job: Path
    expected: Path
    output: Path
    candidates: list[Candidate]
    min_quality: float
    cascades: list[CascadeSpec] = field(default_factory=list)  # of the candidates, scored on their answers
    clear_by: str = "lower"
    scorer: str = DEFAULT_SCORER
    schema: dict[str, Any] | None = None  # for the json scorer
    judge: JudgeConfig | None = None  # when scorer == "judge"
    sample: int = 200
    seed: int = 0
    input_format: str = "auto"
    csv_columns: DocumentOptions = field(default_factory=DocumentOptions)  # a CSV job's prompt and id columns
    hardware: str | None = None
    overwrite: bool = False
    progress: bool = True
    warnings: list[str] = field(default_factory=list)


def choose(config: ChooseConfig, console: Console) -> ChooseReport:
    """Run every candidate on the sample, decide, and write the reports (report.report_files).
    Raises JobError for input that cannot be used (before any run), ScorerError for a scorer that
    fails on a row, KeyboardInterrupt when stopped (what ran is kept: the same command resumes)."""
    refuse_inputs_in(_footprint(config.output), {"the job": config.job, "--expected": config.expected})
    with OutputLock(OutputPaths.from_option(config.output).lock, config.output):
        report = _choose(config, console)
        write_reports(report, config.output)
        return report


def _footprint(out: Path) -> Footprint:
    """What `choose` writes in its folder, `--overwrite` included."""
    files = (*sample_files(out), *report_files(out).values(), OutputPaths.from_option(out).lock)
    return Footprint(with_temporaries(files), tuple(out / name for name in RUN_FOLDERS))


def _choose(config: ChooseConfig, console: Console) -> ChooseReport:
    job = read_job(config.job, config.input_format, config.csv_columns)
    expected = read_expected(config.expected)
    eligible = _eligible(job, expected, config)
    scorer = None if config.judge else make_scorer(config.scorer, expected, config.schema)
    sample = prepare_sample(job, eligible, config.sample, config.seed, config.output, config.overwrite)
    say(console, f"{'reusing' if sample.reused else 'drew'} a sample of {len(sample.ids)} of {len(job.entries)} "
                  f"rows (seed {config.seed}) → {sample.path}")
    results: list[CandidateResult] = []
    evidence: dict[str, TierEvidence] = {}  # each candidate's answers, for the cascades of them
    for candidate in config.candidates:
        result = _run(candidate, sample, config, console)
        answers = _read_answers(config.output / CANDIDATES / candidate.name, sample.ids)
        if config.judge is not None:
            scores = judge_scores(config.judge, candidate.name, answers, _prompts(candidate, sample), expected,
                                  config.output, console, config.progress)
        else:
            assert scorer is not None
            scores = {i: scorer.score(a.text, expected[i], i) for i, a in answers.items() if a.text is not None}
        timing = timed(config.output / CANDIDATES / candidate.name)
        _fill(result, answers, scores, sample, job, timing)
        results.append(result)
        bodies = {i: a.body for i, a in answers.items() if a.body is not None}
        evidence[candidate.name] = TierEvidence(result, bodies, scores, timing)
    by_name = {c.name: c for c in config.candidates}
    for spec in config.cascades:
        tiers = [evidence[name] for name in spec.tiers]
        checks = [acceptance_for(by_name[name], list(spec.accept), f"--candidate {spec.name}: tier")
                  for name in spec.tiers[:-1]]
        results.append(evaluate(spec, tiers, checks, sample.ids, config.min_quality, config.clear_by))
    if config.hardware:
        from tokenmill.choose.ceiling import add_ceilings

        models = {c.name: c.model() for c in config.candidates}
        config.warnings.extend(add_ceilings(results, models, config.hardware))
    verdict = decide(results, config.min_quality, config.clear_by)
    return ChooseReport(
        job=str(config.job), job_rows=len(job.entries), sample=len(sample.ids), seed=config.seed,
        scorer=config.scorer, candidates=results, verdict=verdict, hardware=config.hardware,
        warnings=config.warnings)


def _eligible(job: JobRows, expected: dict[str, Any], config: ChooseConfig) -> list[str]:
    """The job's rows that have an expected answer; the mismatches become warnings."""
    check = compare_ids(job.ids, expected)
    config.warnings.extend(check.warnings())
    if job.invalid_lines:
        config.warnings.append(f"{job.invalid_lines} bad line(s) in the job are left out of the sample")
    missing = set(check.missing)
    eligible = [i for i in job.ids if i not in missing]
    if not eligible:
        raise JobError(f"no row of {config.job} has an expected answer in {config.expected} "
                       f"(the job's ids look like {job.ids[0]!r}, the expected file's like {next(iter(expected))!r})")
    return eligible


# ---- running one candidate ---------------------------------------------------------------------
def _run(candidate: Candidate, sample: Sample, config: ChooseConfig, console: Console) -> CandidateResult:
    """Run (or resume) the candidate's job; a candidate that cannot run gets its reason, and the
    others go on."""
    folder = config.output / CANDIDATES / candidate.name
    result = CandidateResult(candidate.name, candidate.flags_text, candidate.price, rows=len(sample.ids))
    if (earlier := _finished_earlier(candidate, folder, sample.ids)) is not None:
        result.backend, result.model = earlier["backend"], earlier["model"]
        say(console, f"[{candidate.name}] finished in an earlier run: its {len(sample.ids)} rows are reused")
        return result
    say(console, f"\n[{candidate.name}] tokenmill run {candidate.flags_text}")
    try:
        outcome = _run_job(candidate, sample, folder, config.progress, result, console)
    except JobFailed as exc:
        result.status, result.reason = INCOMPLETE, str(exc)
    except (JobError, ValueError, OSError, RuntimeError, ImportError) as exc:  # cannot load, flags changed
        result.status, result.reason = FAILED, f"{type(exc).__name__}: {exc}"
    finally:
        gc.collect()  # the engine's memory goes before the next candidate loads its own
    if result.status != DONE or outcome is None:
        return result
    if outcome.interrupted:  # Ctrl-C / SIGTERM: its rows so far are kept, a re-run resumes
        raise KeyboardInterrupt
    log_run(folder, outcome)
    atomic_write_json(folder / CANDIDATE_FILE, {"flags": candidate.flags_text, "backend": result.backend,
                                                "model": result.model})
    return result


def _run_job(candidate: Candidate, sample: Sample, folder: Path, progress: bool, result: CandidateResult,
             console: Console) -> JobOutcome | None:
    """The job's outcome; None, and FAILED in `result`, when its endpoint does not answer (one probe,
    where the job would keep trying for --retry-for)."""
    with built_backend(candidate.backend) as backend:
        result.backend, result.model = backend.kind, backend.model
        if isinstance(backend, EndpointBackend) and (down := backend.unreachable()) is not None:
            result.status, result.reason = FAILED, f"endpoint down: {down}"
            return None
        outcome = run_job(candidate.job_config(sample.path, folder, progress), backend, console)
    print_summary(outcome, console)
    return outcome


def _finished_earlier(candidate: Candidate, folder: Path, ids: list[str]) -> dict[str, Any] | None:
    """What an earlier run with the same flags recorded, when it left every row final; then there
    is nothing to run, and loading its model only to find that out is skipped."""
    path = folder / CANDIDATE_FILE
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    if earlier.get("flags") != candidate.flags_text or len(_read_answers(folder, ids)) < len(ids):
        return None
    return earlier


# ---- answers and scores ------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    custom_id: str
    text: str | None  # None: the row failed (error) or was not done
    body: dict[str, Any] | None = None
    error: str | None = None  # the error code of a failed row


def _read_answers(folder: Path, ids: list[str]) -> dict[str, Answer]:
    """Each sample row's answer or failure; rows with neither are left out (not done)."""
    answers: dict[str, Answer] = {}
    for row in final_error_rows(folder):
        answers[row["custom_id"]] = Answer(row["custom_id"], None, error=row["error"]["code"])
    for row in result_rows(folder):
        body = row["response"]["body"]
        answers[row["custom_id"]] = Answer(row["custom_id"], answer_of(body) or "", body)
    return {i: answers[i] for i in ids if i in answers}


def _prompts(candidate: Candidate, sample: Sample) -> dict[str, str]:
    """The task each row puts to the model (with the candidate's own system prompt and
    template applied), for the judge."""
    options = candidate.job.options
    spec = read_input(sample.path, options)
    return {r.custom_id: _prompt_text(r.body) for r in spec.requests(spec.entries)}


def _prompt_text(body: dict[str, Any]) -> str:
    if "prompt" in body:
        return str(body["prompt"])
    parts = []
    for message in body["messages"]:
        content = message.get("content")
        text = content if isinstance(content, str) else " ".join(
            p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{message['role']}: {text}")
    return "\n".join(parts)


# ---- what the candidate got, measured and projected -----------------------------------------------
def _fill(result: CandidateResult, answers: dict[str, Answer], scores: dict[str, Score], sample: Sample,
          job: JobRows, timing: dict[str, float]) -> None:
    notes: Counter[str] = Counter()
    values = []
    for custom_id in sample.ids:
        answer = answers.get(custom_id)
        score = scores.get(custom_id) or Score(0.0, f"failed: {answer.error}" if answer else "not done")
        values.append(score.value)
        if score.note:
            notes[score.note] += 1
    answered = [a for a in answers.values() if a.body is not None]
    result.answered, result.failed = len(answered), sum(a.error is not None for a in answers.values())
    if result.status == DONE and len(answers) < len(sample.ids):
        result.status, result.reason = INCOMPLETE, f"{len(sample.ids) - len(answers)} row(s) not done"
    result.quality = quality(values) if answers else None  # nothing ran: no quality to speak of, not 0
    result.notes = dict(notes.most_common())
    for a in answered:
        prompt, _, completion = usage_of(a.body)
        result.prompt_tokens += prompt
        result.output_tokens += completion
    _measure(result, timing)
    _project(result, job, [a.custom_id for a in answered], timing)


def _measure(result: CandidateResult, t: dict[str, float]) -> None:
    if t.get("wall_s") and t.get("completion_tokens"):
        result.output_tok_s = round(t["completion_tokens"] / t["wall_s"], 2)
    if t.get("prefill_s"):
        result.prefill_tok_s = round(t["prefill_tokens"] / t["prefill_s"], 1)
    if result.output_tokens and (result.output_tok_s or result.price.per_hour is None):
        wall = result.output_tokens / result.output_tok_s if result.output_tok_s else None
        usd = result.price.cost(wall, result.prompt_tokens, result.output_tokens)
        result.usd_per_m_output = None if usd is None else usd / result.output_tokens * MILLION


def _project(result: CandidateResult, job: JobRows, answered: list[str], timing: dict[str, float]) -> None:
    """The whole job: prompt tokens from the file's bytes at the sample's tokens per byte, output
    tokens at the sample's mean per row; time at the measured rates, prefill and decode each
    scaled by its own tokens (their split from the engine; by output tokens for an endpoint)."""
    if not answered:
        return
    rows = len(job.entries)
    sample_bytes = sum(job.sizes[i] for i in answered)
    prompt = round(result.prompt_tokens * sum(job.sizes.values()) / sample_bytes)
    output = round(result.output_tokens * rows / len(answered))
    wall = projected_wall(timing, prompt, output)
    result.projected = Projection(rows, prompt, output, wall, result.price.cost(wall, prompt, output))

