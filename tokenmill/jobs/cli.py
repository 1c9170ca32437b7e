"""``tokenmill run``: argument parsing and wiring; the work is in runner.py and the backends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tokenmill.engine import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE
from tokenmill.engine.args import (
    add_engine_arguments,
    add_structured_output_arguments,
    engine_kwargs,
    structured_outputs_from_args,
)
from tokenmill.environment import CLIENT_API_KEY_ENV, client_api_key
from tokenmill.jobs.backend import Backend, BackendUnavailable
from tokenmill.jobs.config import ORDERS, JobConfig
from tokenmill.jobs.output import JobError, JobFailed
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.spec import FORMATS, ID_COLUMNS, PROMPT_COLUMNS, DocumentOptions
from tokenmill.openai_compat import structured_outputs_body
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg
from tokenmill.vllm_engine import add_engine_choice, check_engine_flags, vllm_engine_args

EXIT_JOB_FAILED = 3  # started, then could not go on (Ray stalled, endpoint down past --retry-for); re-run resumes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("input", type=Path, nargs="?",
        help="OpenAI batch JSONL, JSONL with prompt/messages, or text (one document a line)")
    add("-i", "--input", dest="input_option", type=Path, metavar="INPUT",
        help="the input, as a flag (`vllm run-batch -i IN -o OUT` works as it is)")
    add("-o", "--output", type=Path, required=True,
        help="a folder (results.jsonl, errors.jsonl, summary.json, job.json in it) or a results .jsonl file")
    add("--errors", type=Path, help="errors JSONL (default: beside the results)")
    add("--input-format", choices=FORMATS, default="auto", help="default: by suffix and first line")
    add_csv_column_arguments(parser)
    docs = parser.add_argument_group("turning documents into requests (and filling request bodies)")
    docs.add_argument("--system", help="system message for each document (and message lists without one)")
    docs.add_argument("--template", help='user message with "{text}" where the document goes')
    docs.add_argument("--max-tokens", type=int,
                      help=f"for bodies without max_tokens, whatever the backend (default {DEFAULT_MAX_TOKENS}); "
                      "the summary counts the rows it capped")
    docs.add_argument("--temperature", type=float,
                      help=f"for bodies without temperature (default {DEFAULT_TEMPERATURE:g}, OpenAI's; 0 = greedy)")
    docs.add_argument("--completions", action="store_true",
                      help="send documents to /v1/completions as plain prompts instead of chat")
    add_structured_output_arguments(
        parser, "structured outputs, for every row that asks for none of its own (docs/jobs.md)")
    ep = parser.add_argument_group("endpoint backend")
    ep.add_argument("--endpoint", action="append",
                    help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1 "
                    "(with --ray, repeat it to spread batches over several servers)")
    ep.add_argument("--api-key", help=f"bearer token (default: ${' or $'.join(CLIENT_API_KEY_ENV)})")
    ep.add_argument("--concurrency", type=int, default=16,
                    help="requests in flight (default 16; with --ray, in all replicas together)")
    ep.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt (default 600)")
    ep.add_argument("--retry-for", type=float, default=600.0, metavar="SECONDS",
                    help="keep retrying a request's 429s, 5xx, timeouts and lost connections this long; an "
                    "endpoint that stays down this long (no answer to probes) ends the job with exit 3, and a "
                    "re-run resumes (default 600)")
    ep.add_argument("--max-attempts", type=int,
                    help="also cap the tries per request (default: no cap, --retry-for decides)")
    run = parser.add_argument_group("running")
    run.add_argument("--order", choices=ORDERS, default="input",
                     help="input order, or the biggest requests first, in length buckets (see docs/jobs.md)")
    run.add_argument("--strict", action="store_true", help="refuse the whole job if any line is bad")
    run.add_argument("--overwrite", action="store_true", help="discard existing output files and start over")
    run.add_argument("--price-per-hour", type=price_per_hour_arg, help=f"for the cost in the summary: {PRICE_HELP}")
    run.add_argument("--no-progress", action="store_true", help="no live progress bar")
    ray = parser.add_argument_group("scaling out on a Ray cluster (pip install 'tokenmill[ray]'; docs/jobs.md)")
    ray.add_argument("--ray", action="store_true", help="run the job data parallel on Ray, one engine per replica")
    ray.add_argument("--ray-address", help="auto, ray://HOST:10001, … (default: $RAY_ADDRESS, a cluster "
                     "started on this machine, else a new local one)")
    ray.add_argument("--replicas", type=int, default=1, help="Ray actors, each with its own engine (default 1)")
    ray.add_argument("--cpus-per-replica", type=float, default=1.0, help="default 1 (also its torch threads)")
    ray.add_argument("--gpus-per-replica", type=float, default=0.0, help="default 0")
    ray.add_argument("--ray-batch-size", type=int,
                     help="requests per batch sent to a replica (default 4 × --max-num-seqs, or 4 × its share "
                     "of --concurrency); the unit re-run when a replica dies")
    ray.add_argument("--no-progress-timeout", type=float, default=1800.0,
                     help="fail when no batch finishes for this many seconds (default 1800; keep it above "
                     "the time one batch takes)")
    add_engine_choice(parser)
    add_engine_arguments(parser, title="the embedded engine (EngineConfig; not used with --endpoint)", help={
        "model": "embedded: GGUF file, HF folder or hub id (default: the embedded SmolLM2); with --endpoint: "
                 "the model name sent in every body"})


def add_csv_column_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CSV input (.csv, .tsv, or --input-format csv): the other columns are "
                                      "kept as each row's metadata")
    group.add_argument("--prompt-column", metavar="NAME",
                       help=f"the prompt's column (default: {' or '.join(PROMPT_COLUMNS)})")
    group.add_argument("--id-column", metavar="NAME",
                       help=f"the custom_id's column (default: {' or '.join(ID_COLUMNS)} if there is one, "
                       "else line-N)")


def run(args: argparse.Namespace) -> int:
    try:
        return run_job(job_config(args), make_backend(args))
    except JobFailed as exc:
        print(f"tokenmill run: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    except (JobError, BackendUnavailable) as exc:
        print(f"tokenmill run: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the work started (validation); nothing to resume yet
        print("tokenmill run: interrupted before any request ran", file=sys.stderr)
        return 130


def job_config(args: argparse.Namespace) -> JobConfig:
    """The job the flags ask for (`tokenmill choose` builds each candidate's job here too)."""
    options = DocumentOptions(
        system=args.system, template=args.template, max_tokens=args.max_tokens,
        temperature=args.temperature, model=args.model if args.endpoint else None,
        completions=args.completions, structured_outputs=_structured_outputs(args),
        prompt_column=args.prompt_column, id_column=args.id_column,
    )
    return JobConfig(
        input=_input(args), output=args.output, options=options, errors=args.errors,
        input_format=args.input_format, strict=args.strict, overwrite=args.overwrite, order=args.order,
        price_per_hour=args.price_per_hour, progress=not args.no_progress,
    )


def _input(args: argparse.Namespace) -> Path:
    """The input file, given once: as the first argument or with -i/--input."""
    given = [p for p in (args.input, getattr(args, "input_option", None)) if p is not None]
    if len(given) != 1:
        raise JobError("give the input file once: as the first argument or with -i/--input"
                       + (f" (got {given[0]} and {given[1]})" if given else ""))
    return given[0]


def _structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """--json-schema / --choice / --regex as the body field asking for it; JobError, before any
    work, for a value that cannot be one."""
    try:
        setting = structured_outputs_from_args(args)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    return None if setting is None else structured_outputs_body(setting)


def make_backend(args: argparse.Namespace) -> Backend:
    """The backend the flags ask for: the embedded engine, an endpoint, or Ray replicas of either."""
    endpoints = args.endpoint or []
    try:
        check_engine_flags(args)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    if endpoints and args.engine == "vllm":
        raise JobError("--engine vllm runs vLLM in this process; --endpoint sends to a server instead: give one")
    if len(endpoints) > 1 and not args.ray:
        raise JobError("several --endpoint need --ray (each replica spreads its batches over them)")
    ray_only = {"--ray-address": args.ray_address, "--replicas": args.replicas != 1,
                "--cpus-per-replica": args.cpus_per_replica != 1, "--gpus-per-replica": args.gpus_per_replica,
                "--ray-batch-size": args.ray_batch_size}
    if not args.ray and any(ray_only.values()):
        raise JobError(f"{', '.join(k for k, v in ray_only.items() if v)} need --ray")
    if not args.ray:
        return _endpoint(args, endpoints[0], args.concurrency) if endpoints else _embedded(args)
    from tokenmill.jobs.ray_runner import RayBackend, RayOptions

    if endpoints:
        if args.concurrency < args.replicas:
            raise JobError(f"--concurrency {args.concurrency} is below --replicas {args.replicas}: "
                           "each replica needs at least one request in flight")
        share = args.concurrency // args.replicas  # the global bound: replicas × share <= --concurrency
        backends: list[Backend] = [_endpoint(args, url, share) for url in endpoints]
    else:
        share = args.max_num_seqs
        # A replica's torch threads = its CPUs (unless set), so replicas on one machine do not fight for cores.
        backends = [_embedded(args, num_threads=args.num_threads or max(1, int(args.cpus_per_replica)))]
    options = RayOptions(
        address=args.ray_address, replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica, batch_size=args.ray_batch_size or 4 * share,
        no_progress_timeout_s=args.no_progress_timeout,
    )
    return RayBackend(backends, options)


def _endpoint(args: argparse.Namespace, url: str, concurrency: int) -> Backend:
    from tokenmill.jobs.endpoint import EndpointBackend, RetryPolicy

    return EndpointBackend(
        url, api_key=client_api_key(args.api_key), concurrency=concurrency, timeout=args.timeout,
        retry=RetryPolicy(retry_for=args.retry_for, max_attempts=args.max_attempts), model=args.model,
    )


def _embedded(args: argparse.Namespace, **overrides: Any) -> Backend:
    """An in-process engine: the embedded one, or vLLM's with --engine vllm."""
    from tokenmill.jobs.embedded import EmbeddedBackend

    if args.engine == "vllm":
        overrides = {"engine": "vllm", "vllm_args": vllm_engine_args(args)}
    return EmbeddedBackend(**{**engine_kwargs(args), **overrides})
