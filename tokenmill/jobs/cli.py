"""``tokenmill run``: argument parsing and wiring; the work is in runner.py and the backends."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tokenmill.jobs.output import JobError
from tokenmill.jobs.runner import ORDERS, Backend, JobConfig, run_job
from tokenmill.jobs.spec import FORMATS, DocumentOptions

API_KEY_ENV = ("TOKENMILL_API_KEY", "OPENAI_API_KEY")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("input", type=Path, help="OpenAI batch JSONL, JSONL with prompt/messages, or text (one document a line)")
    add("-o", "--output", type=Path, required=True,
        help="a folder (results.jsonl, errors.jsonl, summary.json, job.json in it) or a results .jsonl file")
    add("--errors", type=Path, help="errors JSONL (default: beside the results)")
    add("--input-format", choices=FORMATS, default="auto", help="default: by suffix and first line")
    docs = parser.add_argument_group("turning documents into requests (and filling request bodies)")
    docs.add_argument("--system", help="system message for each document (and message lists without one)")
    docs.add_argument("--template", help='user message with "{text}" where the document goes')
    docs.add_argument("--max-tokens", type=int, help="for bodies without max_tokens (default 256)")
    docs.add_argument("--temperature", type=float, help="for bodies without temperature (default 1.0)")
    docs.add_argument("--completions", action="store_true",
                      help="send documents to /v1/completions as plain prompts instead of chat")
    docs.add_argument("--model", help="embedded: GGUF file, HF folder or hub id (default: embedded SmolLM2); "
                      "with --endpoint: the model name sent in every body")
    ep = parser.add_argument_group("endpoint backend")
    ep.add_argument("--endpoint", help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1")
    ep.add_argument("--api-key", help=f"bearer token (default: ${API_KEY_ENV[0]} or ${API_KEY_ENV[1]})")
    ep.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    ep.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt (default 600)")
    ep.add_argument("--max-attempts", type=int, default=6, help="tries per request (default 6)")
    run = parser.add_argument_group("running")
    run.add_argument("--max-num-seqs", type=int, default=64, help="embedded: sequences in the batch (default 64)")
    run.add_argument("--order", choices=ORDERS, default="input",
                     help="input order, or the biggest requests first, in length buckets (see docs/jobs.md)")
    run.add_argument("--strict", action="store_true", help="refuse the whole job if any line is bad")
    run.add_argument("--overwrite", action="store_true", help="discard existing output files and start over")
    run.add_argument("--price-per-hour", type=float, help="hardware $/hour, for cost per token in the summary")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")


def run(args: argparse.Namespace) -> int:
    try:
        options = DocumentOptions(
            system=args.system, template=args.template, max_tokens=args.max_tokens,
            temperature=args.temperature, model=args.model if args.endpoint else None,
            completions=args.completions,
        )
        config = JobConfig(
            input=args.input, output=args.output, options=options, errors=args.errors,
            input_format=args.input_format, strict=args.strict, overwrite=args.overwrite, order=args.order,
            price_per_hour=args.price_per_hour, progress=not args.no_progress,
        )
        return run_job(config, _backend(args))
    except JobError as exc:
        print(f"tokenmill run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the work started (validation); nothing to resume yet
        print("tokenmill run: interrupted before any request ran", file=sys.stderr)
        return 130


def _backend(args: argparse.Namespace) -> Backend:
    if args.endpoint:
        from tokenmill.jobs.endpoint import EndpointBackend, RetryPolicy

        api_key = args.api_key or next((os.environ[k] for k in API_KEY_ENV if os.environ.get(k)), None)
        return EndpointBackend(
            args.endpoint, api_key=api_key, concurrency=args.concurrency, timeout=args.timeout,
            retry=RetryPolicy(max_attempts=args.max_attempts), model=args.model,
        )
    from tokenmill.jobs.embedded import EmbeddedBackend

    return EmbeddedBackend(args.model, max_num_seqs=args.max_num_seqs)
