"""``tokenmill split``: flags → `split_input` (parts.py) → one line per part written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.jobs.backends import OPENAI_MAX_BYTES, OPENAI_MAX_REQUESTS
from tokenmill.jobs.flags import add_csv_column_arguments, add_document_arguments
from tokenmill.jobs.input import FORMATS, DocumentOptions
from tokenmill.jobs.storage import check_input, check_output
from tokenmill.settings import given_settings, in_flags, name_flags
from tokenmill.split.parts import WrittenPart, split_input

__all__ = ["add_arguments", "run"]

EXIT_OK, EXIT_BAD_LINES, EXIT_BAD_INPUT = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("input", type=Path, help="any `tokenmill run` input: batch JSONL, JSONL with prompt/messages, text, CSV")
    add("-o", "--output", type=Path, required=True, metavar="DIR",
        help="folder for part-00001.jsonl, part-00002.jsonl, … (and errors.jsonl for bad lines)")
    add("--max-requests", type=int, default=OPENAI_MAX_REQUESTS, metavar="N",
        help=f"requests in one file (default {OPENAI_MAX_REQUESTS}, OpenAI's limit)")
    add("--max-bytes", type=int, default=OPENAI_MAX_BYTES, metavar="N",
        help=f"bytes in one file (default {OPENAI_MAX_BYTES} = 200 MB, OpenAI's limit)")
    add("--input-format", choices=FORMATS, default="auto", help="default: by suffix and first line")
    add("--model", help="the model name set in every body (OpenAI's Batch API needs one in each)")
    add("--overwrite", action="store_true", help="replace the part and error files of an earlier split in DIR")
    add_csv_column_arguments(parser)
    add_document_arguments(parser)
    name_flags(parser, max_requests="--max-requests", max_bytes="--max-bytes")


def run(args: argparse.Namespace) -> int:
    try:
        check_input(args.input)  # before any work: a missing or unreadable input, an -o that cannot be written
        check_output(args.output)
        options = DocumentOptions(model=args.model, **given_settings(args, DocumentOptions))
        outcome = split_input(args.input, args.output, options, args.input_format, args.max_requests,
                              args.max_bytes, args.overwrite, on_part=_print_part)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenmill split: {in_flags(exc, args)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if outcome.errors_path is not None:
        print(f"tokenmill split: {outcome.bad_lines} bad line(s), in no part → {outcome.errors_path}:",
              file=sys.stderr)
        for message in outcome.first_errors:
            print(f"  {message}", file=sys.stderr)
        if outcome.bad_lines > len(outcome.first_errors):
            print(f"  … and {outcome.bad_lines - len(outcome.first_errors)} more", file=sys.stderr)
        return EXIT_BAD_LINES
    if not outcome.parts:
        print(f"tokenmill split: {args.input}: no requests (the file is empty)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def _print_part(part: WrittenPart) -> None:
    print(f"{part.path}  {part.requests} request(s)  {part.bytes:,} bytes  {part.url}", flush=True)
