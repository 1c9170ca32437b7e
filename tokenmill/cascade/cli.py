"""``tokenmill cascade``: flags → `CascadeConfig` → `run_cascade`; the work is in runner.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from tokenmill.cascade.runner import CascadeConfig, run_cascade
from tokenmill.cascade.summary import print_cascade
from tokenmill.choose.acceptance import FORMS
from tokenmill.choose.candidates import parse_candidate
from tokenmill.environment import readable_file, writable_folder
from tokenmill.jobs import ExitCode, JobError, JobFailed
from tokenmill.jobs import flags as run_flags
from tokenmill.jobs.input import FORMATS, DocumentOptions
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("input", type=Path, help="the job, as `tokenmill run` takes it (batch JSONL, JSONL, text or CSV)")
    add("-o", "--output", type=Path, required=True,
        help="a folder: results.jsonl and errors.jsonl (every row once), summary.json, each tier's job in tiers/NAME/")
    add("--tier", action="append", required=True, metavar="NAME=FLAGS",
        help="a tier and its `tokenmill run` flags, cheapest first; repeat it (at least two). Prices as for "
        "`tokenmill choose` candidates: --price-per-hour, or --price-per-m-input and --price-per-m-output")
    add("--accept", action="append", required=True, metavar="CHECK",
        help=f"what an answer must pass to stop at its tier (every tier but the last); repeat it to require "
        f"several: {', '.join(FORMS)} (docs/cascade.md)")
    add("--flags", default="", metavar="FLAGS", help="`tokenmill run` flags every tier gets before its own")
    add("--price-per-hour", type=price_per_hour_arg, help=f"for tiers that give no price of their own: {PRICE_HELP}")
    add("--input-format", choices=FORMATS, default="auto", help="the job's format (default: by suffix and first line)")
    run_flags.add_csv_column_arguments(parser)
    add("--overwrite", action="store_true", help="discard this folder's tiers and start over")
    add("--no-progress", action="store_true", help="no live progress bars")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        outcome = run_cascade(_config(args), console)
    except KeyboardInterrupt:
        print("tokenmill cascade: interrupted; what ran is kept: re-run the same command to resume", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except JobFailed as exc:
        print(f"tokenmill cascade: {exc}", file=sys.stderr)
        return ExitCode.JOB_FAILED
    except (JobError, ValueError, FileNotFoundError) as exc:
        print(f"tokenmill cascade: error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print_cascade(outcome, Console() if sys.stdout.isatty() else Console(width=200))
    return ExitCode.FAILED if any(t.failed for t in outcome.tiers) else ExitCode.OK


def _config(args: argparse.Namespace) -> CascadeConfig:
    readable_file(args.input, "input")  # before any work (environment.PathError)
    writable_folder(args.output, "-o")
    tiers = [parse_candidate(text, args.flags, args.price_per_hour, flag="--tier", command="cascade")
             for text in args.tier]
    return CascadeConfig(
        input=args.input, output=args.output, tiers=tiers, accept=args.accept, input_format=args.input_format,
        csv_columns=DocumentOptions(prompt_column=args.prompt_column, id_column=args.id_column),
        overwrite=args.overwrite, progress=not args.no_progress)
