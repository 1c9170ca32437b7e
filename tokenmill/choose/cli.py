"""``tokenmill choose``: argument parsing and wiring; the work is in runner.py."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from tokenmill.choose.acceptance import acceptance_for
from tokenmill.choose.candidates import Candidate, parse_candidate
from tokenmill.choose.cascades import CascadeSpec, is_cascade, parse_cascade
from tokenmill.choose.judge import DEFAULT_RUBRIC, check_rubric
from tokenmill.choose.judge_job import JudgeConfig
from tokenmill.choose.report import print_report, report_files
from tokenmill.choose.results import CLEAR_BY, DONE
from tokenmill.choose.runner import ChooseConfig, choose
from tokenmill.choose.scorers import DEFAULT_SCORER, SCORERS
from tokenmill.environment import CLIENT_API_KEY_ENV, client_api_key, readable_file, writable_folder
from tokenmill.jobs import ExitCode
from tokenmill.jobs import flags as run_flags
from tokenmill.jobs.input import FORMATS, DocumentOptions
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("job", type=Path, help="the job's input, as `tokenmill run` takes it (batch JSONL, JSONL or text)")
    add("--expected", type=Path, required=True,
        help='JSONL: {"custom_id" (or "id"), "expected" (or one other field, e.g. "label")} a line')
    add("-o", "--output", type=Path, required=True,
        help="a folder: the sample, each candidate's job under candidates/NAME/, report.{md,json,png}")
    add("--candidate", action="append", required=True, metavar="NAME=FLAGS",
        help="a candidate and its `tokenmill run` flags, e.g. 'local=--price-per-hour 0.1', "
        "'api=--endpoint URL --model M --price-per-m-input 0.15 --price-per-m-output 0.6'; repeat it. A cascade "
        "of other candidates: 'local-then-api=cascade:local,api --accept CHECK' (a confidence check without "
        "its threshold, e.g. --accept min-logprob, is calibrated on the sample; docs/cascade.md)")
    add("--flags", default="", metavar="FLAGS", help="`tokenmill run` flags every candidate gets before its own "
        "(a single flag as --flags=--no-progress, so that it is not read as one of choose's)")
    add("--min-quality", type=_fraction, required=True, help="the bar, a mean score in 0..1")
    add("--clear-by", choices=CLEAR_BY, default=ChooseConfig.clear_by,
        help="clear the bar by the 95%% interval's lower bound (default) or by the mean")
    add("--sample", type=int, default=ChooseConfig.sample,
        help=f"rows to draw (default {ChooseConfig.sample}; all rows if the job has fewer)")
    add("--seed", type=int, default=ChooseConfig.seed, help=f"the draw's seed (default {ChooseConfig.seed})")
    add("--input-format", choices=FORMATS, default="auto", help="the job's format (default: by suffix and first line)")
    run_flags.add_csv_column_arguments(parser)
    add("--price-per-hour", type=price_per_hour_arg,
        help=f"for candidates that give no price of their own: {PRICE_HELP}")
    add("--hardware", help="also show each embedded candidate's ceiling $/M on this hardware (the planner's "
        "catalog name, or this-machine): a bound, not a measurement")
    add("--overwrite", action="store_true", help="discard this folder's sample and runs and start over")
    add("--no-progress", action="store_true", help="no live progress bars")
    score = parser.add_argument_group("scoring")
    score.add_argument("--scorer", default=DEFAULT_SCORER,
                       help=f"{', '.join(SCORERS)}, or python:MODULE:FUNCTION / python:FILE.py:FUNCTION "
                       f"(function(answer, expected) -> 0..1) (default {DEFAULT_SCORER}; docs/choose.md)")
    score.add_argument("--schema", type=Path, help="json scorer: a JSON Schema the answers must follow")
    judge = parser.add_argument_group("the judge (--scorer judge): an OpenAI-compatible endpoint grades each answer")
    judge.add_argument("--judge-endpoint", metavar="URL", help="e.g. http://localhost:8000/v1")
    judge.add_argument("--judge-model", help="the model name sent in every judge request")
    judge.add_argument("--judge-rubric", type=Path,
                       help="the judge's prompt, with {answer} and optionally {prompt} and {expected}; it must "
                       "ask for a last line 'SCORE: n' (n of 10) (default: a correctness rubric)")
    judge.add_argument("--judge-api-key", help=f"bearer token (default: ${' or $'.join(CLIENT_API_KEY_ENV)})")
    judge.add_argument("--judge-concurrency", type=int, default=8, help="judge requests in flight (default 8)")
    judge.add_argument("--judge-retry-for", type=float, default=600.0, metavar="SECONDS",
                       help="as --retry-for of `tokenmill run` (default 600)")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in 0..1, got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in 0..1, got {value:g}")
    return value


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        config = _config(args)
        report = choose(config, console)
    except KeyboardInterrupt:
        print("tokenmill choose: interrupted; what ran is kept: re-run the same command to resume", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except (ValueError, FileNotFoundError) as exc:  # bad input, a candidate's flags, a scorer that failed
        print(f"tokenmill choose: error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    # A terminal's own width; 200 columns in a pipe or a log, where rich would assume 80 and squeeze the table.
    print_report(report, Console() if sys.stdout.isatty() else Console(width=200))
    for kind, path in report_files(config.output).items():
        console.print(f"{kind}: {path}", markup=False, highlight=False)
    return ExitCode.OK if all(c.status == DONE for c in report.candidates) else ExitCode.FAILED


def _config(args: argparse.Namespace) -> ChooseConfig:
    _check_paths(args)
    if args.hardware:
        _check_hardware(args.hardware)
    candidates = [parse_candidate(text, args.flags, args.price_per_hour)
                  for text in args.candidate if not is_cascade(text)]
    cascades = [parse_cascade(text, [c.name for c in candidates]) for text in args.candidate if is_cascade(text)]
    names = [c.name for c in candidates] + [c.name for c in cascades]
    if len(set(names)) < len(names):
        raise ValueError(f"--candidate names must differ: {sorted({n for n in names if names.count(n) > 1})}")
    return ChooseConfig(
        job=args.job, expected=args.expected, output=args.output,
        candidates=_with_logprobs(candidates, cascades, args), cascades=cascades,
        min_quality=args.min_quality, clear_by=args.clear_by, scorer=args.scorer, schema=_schema(args),
        judge=_judge(args), sample=args.sample, seed=args.seed, input_format=args.input_format,
        csv_columns=DocumentOptions(prompt_column=args.prompt_column, id_column=args.id_column),
        hardware=args.hardware, overwrite=args.overwrite, progress=not args.no_progress,
    )


def _check_paths(args: argparse.Namespace) -> None:
    """The files choose reads and the folder it writes, before any work (environment.PathError)."""
    readable_file(args.job, "the job")
    readable_file(args.expected, "--expected")
    for flag, path in (("--schema", args.schema), ("--judge-rubric", args.judge_rubric)):
        if path is not None:
            readable_file(path, flag)
    writable_folder(args.output, "-o")


def _with_logprobs(candidates: list[Candidate], cascades: list[CascadeSpec], args: argparse.Namespace
                   ) -> list[Candidate]:
    """The candidates, those that are an early tier of a cascade with a confidence check asking
    for the log-probabilities it reads (`--logprobs N` added to their flags, so the report says so)."""
    by_name = {c.name: c for c in candidates}
    needs: dict[str, int] = {}
    for spec in cascades:
        for name in spec.tiers[:-1]:
            wanted = acceptance_for(by_name[name], list(spec.accept), f"--candidate {spec.name}: tier").logprobs
            if wanted is not None:
                needs[name] = max(needs.get(name, 0), wanted)
    return [parse_candidate(f"{c.name}={shlex.join(c.flags)} --logprobs {needs[c.name]}", args.flags,
                            args.price_per_hour) if c.name in needs else c for c in candidates]


def _check_hardware(name: str) -> None:
    from tokenmill.plan import get_hardware
    from tokenmill.plan.catalog import THIS_MACHINE

    if name.lower() != THIS_MACHINE:
        get_hardware(name)  # PlanError (a ValueError) naming the known ones


def _schema(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.schema is None:
        return None
    try:
        schema = json.loads(args.schema.read_text())
    except ValueError as exc:
        raise ValueError(f"--schema {args.schema}: not JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--schema {args.schema}: a JSON Schema is an object")
    return schema


def _judge(args: argparse.Namespace) -> JudgeConfig | None:
    judge_flags = [f for f in ("judge_endpoint", "judge_model", "judge_rubric", "judge_api_key") if getattr(args, f)]
    if args.scorer != "judge":
        if judge_flags:
            raise ValueError(f"--{judge_flags[0].replace('_', '-')} needs --scorer judge")
        return None
    if not args.judge_endpoint:
        raise ValueError("--scorer judge needs --judge-endpoint (an OpenAI-compatible server to grade the answers)")
    rubric = args.judge_rubric.read_text() if args.judge_rubric else DEFAULT_RUBRIC
    try:
        check_rubric(rubric)
    except ValueError as exc:
        raise ValueError(f"--judge-rubric {args.judge_rubric}: {exc}") from None
    return JudgeConfig(args.judge_endpoint, rubric, args.judge_model, client_api_key(args.judge_api_key),
                       args.judge_concurrency, args.judge_retry_for)
