"""`tokenmill run`'s flags, and the one place they become typed objects: the job (`JobConfig`) and
its backend (`BackendSpec`, backend_specs.py). `tokenmill run` (jobs/cli.py) and each `tokenmill
choose` candidate parse their flags with these, so a flag means the same in both; below this,
nothing sees an argparse Namespace.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.engine import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_LOGPROBS
from tokenmill.engine.args import (
    add_engine_arguments,
    add_structured_output_arguments,
    structured_outputs_from_args,
)
from tokenmill.environment import CLIENT_API_KEY_ENV, NAMED_MODELS, client_api_key, readable_file
from tokenmill.jobs.backends.ray import RayOptions, RaySpec
from tokenmill.jobs.config import ORDERS, OUTPUT_FORMATS, JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.reader import FORMATS, ID_COLUMNS, PROMPT_COLUMNS
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.journal.parts import PART_ROWS
from tokenmill.jobs.storage import Location, location
from tokenmill.openai_compat import structured_outputs_body
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg
from tokenmill.vllm_engine.args import add_engine_choice, engine_spec

if TYPE_CHECKING:
    from tokenmill.jobs.backends.batch_api import BatchApiSpec
    from tokenmill.jobs.backends.build import BackendSpec

BATCH_API_ONLY_FLAGS = {"--poll-interval": "poll_interval", "--max-requests-per-part": "max_requests_per_part",
                        "--max-bytes-per-part": "max_bytes_per_part"}
RAY_ONLY_FLAGS = {"--ray-address": "ray_address", "--replicas": "replicas", "--cpus-per-replica": "cpus_per_replica",
                  "--gpus-per-replica": "gpus_per_replica", "--ray-batch-size": "ray_batch_size"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("input", type=location, nargs="?",
        help="OpenAI batch JSONL, JSONL with prompt/messages, or text (one document a line); a path or a URL "
        "(s3://, gs://, az://, https://, … through fsspec)")
    add("-i", "--input", dest="input_option", type=location, metavar="INPUT",
        help="the input, as a flag (`vllm run-batch -i IN -o OUT` works as it is)")
    add("-o", "--output", type=location, required=True,
        help="a folder (results.jsonl, errors.jsonl, summary.json, job.json in it) or a results .jsonl file; "
        "a URL (s3://bucket/out/, …) is a folder: results/part-*.jsonl, committed as the job goes")
    add("--errors", type=Path, help="errors JSONL (default: beside the results)")
    add("--output-format", choices=OUTPUT_FORMATS, default="jsonl",
        help="the results as committed parts OUT/results/part-*.jsonl or .parquet (one column per field; "
        "a local -o keeps OUT/results.jsonl as the journal); errors stay JSONL (default jsonl)")
    add("--part-rows", type=int, default=PART_ROWS, metavar="N",
        help=f"a URL -o or parquet: commit a part every N result rows, and at the end of each run (default "
        f"{PART_ROWS:,}; at most N rows are redone after a lost machine)")
    add("--spool-dir", type=Path, metavar="DIR",
        help="a URL -o: the local journal it is committed from (default: $TOKENMILL_CACHE/jobs/<hash of the URL>)")
    add("--input-format", choices=FORMATS, default="auto", help="default: by suffix and first line")
    add_csv_column_arguments(parser)
    add_document_arguments(parser)
    add("--logprobs", type=int, metavar="N",
        help=f"return each answer token's log-probability and the N most likely alternatives (0..{MAX_LOGPROBS}), "
        "OpenAI-shaped, in every result row (rows that say whether they want logprobs keep their own; "
        "/v1/completions rows take 0..5)")
    add_structured_output_arguments(
        parser, "structured outputs, for every row that asks for none of its own (docs/jobs.md)")
    ep = parser.add_argument_group("endpoint backend")
    ep.add_argument("--endpoint", action="append",
                    help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1; repeat it to "
                    "spread the rows over several servers, each taking the next row when it has a worker free "
                    "(a faster one takes more; with --ray, each batch goes to one of them)")
    ep.add_argument("--api-key", help=f"bearer token (default: ${' or $'.join(CLIENT_API_KEY_ENV)})")
    ep.add_argument("--concurrency", type=int,
                    help="requests in flight to each endpoint (default 16; with --ray, in all replicas together)")
    ep.add_argument("--max-requests-per-minute", type=float, metavar="N",
                    help="send each endpoint at most N requests a minute (OpenAI's RPM), in bursts of at most one "
                    "second's share (default: no limit; with --ray, the replicas share it)")
    ep.add_argument("--max-tokens-per-minute", type=float, metavar="N",
                    help="send each endpoint at most N tokens a minute (OpenAI's TPM), counted as OpenAI counts "
                    "them when a request is sent: its prompt's characters ÷ 4 + max_tokens (default: no limit)")
    ep.add_argument("--timeout", type=float, default=600.0, help="seconds per attempt (default 600)")
    ep.add_argument("--retry-for", type=float, default=600.0, metavar="SECONDS",
                    help="keep retrying a request's 429s, 5xx, timeouts and lost connections this long; an "
                    "endpoint that stays down this long (no answer to probes) ends the job with exit 3, and a "
                    "re-run resumes (default 600)")
    ep.add_argument("--max-attempts", type=int,
                    help="also cap the tries per request (default: no cap, --retry-for decides)")
    add_batch_api_arguments(parser)
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
    ray.add_argument("--replicas", type=int,
                     help=f"Ray actors, each with its own engine (default {RayOptions.replicas})")
    ray.add_argument("--cpus-per-replica", type=float,
                     help=f"default {RayOptions.cpus_per_replica:g} (also its torch threads)")
    ray.add_argument("--gpus-per-replica", type=float, help=f"default {RayOptions.gpus_per_replica:g}")
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


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    """How documents become requests (`tokenmill split` takes these too)."""
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


def add_batch_api_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("half-price batches through the endpoint's Batch API (docs/jobs.md)")
    group.add_argument("--batch-api", action="store_true",
                       help="with --endpoint: submit the job through its Batch API (/v1/files + /v1/batches; "
                       "OpenAI bills batches at half price) instead of live requests, and wait for the batches")
    group.add_argument("--poll-interval", type=float, metavar="SECONDS",
                       help="--batch-api: seconds between status checks of the batches (default 30)")
    group.add_argument("--max-requests-per-part", type=int, metavar="N",
                       help="--batch-api: requests in one uploaded file (default 50000, OpenAI's limit)")
    group.add_argument("--max-bytes-per-part", type=int, metavar="N",
                       help="--batch-api: bytes in one uploaded file (default 209715200 = 200 MB, OpenAI's limit)")


def add_csv_column_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CSV input (.csv, .tsv, or --input-format csv): the other columns are "
                                      "kept as each row's metadata")
    group.add_argument("--prompt-column", metavar="NAME",
                       help=f"the prompt's column (default: {' or '.join(PROMPT_COLUMNS)})")
    group.add_argument("--id-column", metavar="NAME",
                       help=f"the custom_id's column (default: {' or '.join(ID_COLUMNS)} if there is one, "
                       "else line-N)")


def parse_job(args: argparse.Namespace) -> tuple[JobConfig, BackendSpec]:
    """The job and the backend the flags ask for; JobError naming the flag for any that cannot be."""
    try:
        return job_config(args), backend_spec(args)
    except JobError:
        raise
    except ValueError as exc:
        raise JobError(str(exc)) from None


def job_config(args: argparse.Namespace) -> JobConfig:
    """The job the flags ask for (`tokenmill choose` builds each candidate's job here too)."""
    options = DocumentOptions(
        system=args.system, template=args.template, max_tokens=args.max_tokens,
        temperature=args.temperature, model=args.model if args.endpoint else None,
        completions=args.completions, structured_outputs=_structured_outputs(args),
        prompt_column=args.prompt_column, id_column=args.id_column, logprobs=args.logprobs,
    )
    return JobConfig(
        input=_input(args), output=args.output, options=options, errors=args.errors,
        input_format=args.input_format, strict=args.strict, overwrite=args.overwrite, order=args.order,
        price_per_hour=args.price_per_hour, progress=not args.no_progress,
        output_format=args.output_format, part_rows=args.part_rows, spool_dir=args.spool_dir,
    )


def _input(args: argparse.Namespace) -> Location:
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


def backend_spec(args: argparse.Namespace) -> BackendSpec:
    """The backend the flags ask for: the embedded engine, vLLM's, an endpoint, or Ray replicas of
    any of them. ValueError naming the flag for a combination that cannot be."""
    from tokenmill.jobs.backends.endpoint import EndpointSpec
    from tokenmill.jobs.backends.http import RetryPolicy
    from tokenmill.jobs.backends.rate_limit import RateLimit

    if args.batch_api or any(getattr(args, dest) is not None for dest in BATCH_API_ONLY_FLAGS.values()):
        return batch_api_spec(args)
    urls = args.endpoint or []
    if urls and args.engine == "vllm":
        raise ValueError("--engine vllm runs vLLM in this process; --endpoint sends to a server instead: give one")
    rate_limit = RateLimit(args.max_requests_per_minute, args.max_tokens_per_minute)
    if rate_limit.limited and not urls:
        raise ValueError("--max-requests-per-minute and --max-tokens-per-minute pace an --endpoint: give one")
    given_ray_flags = [name for name, dest in RAY_ONLY_FLAGS.items() if getattr(args, dest) is not None]
    if given_ray_flags and not args.ray:
        raise ValueError(f"{', '.join(given_ray_flags)} need --ray")
    if urls:
        retry = RetryPolicy(retry_for=args.retry_for, max_attempts=args.max_attempts)
        given = _given(concurrency=args.concurrency)
        endpoints = tuple(EndpointSpec(url, args.model, client_api_key(args.api_key), timeout_s=args.timeout,
                                       retry=retry, rate_limit=rate_limit, **given) for url in urls)
    if not urls:
        check_model_path(args.model)
    engine = None if urls else engine_spec(args)
    if not args.ray:
        if urls:  # several: one process spreads the rows over them (endpoint.py)
            return endpoints[0] if len(endpoints) == 1 else endpoints
        return engine  # type: ignore[return-value]
    options = RayOptions(address=args.ray_address, batch_size=args.ray_batch_size,
                         no_progress_timeout_s=args.no_progress_timeout,
                         **_given(replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
                                  gpus_per_replica=args.gpus_per_replica))
    return RaySpec(endpoints if urls else engine, options)  # type: ignore[arg-type]


def check_model_path(model: str | None) -> None:
    """Refuse, before the output is claimed, an embedded --model that names no file or folder we can
    read: an existing path must be readable, and one that does not exist must be a named model or
    a hub id (ORG/NAME) for the loader to fetch. The loader says why a file is not a model."""
    if model is None or model in NAMED_MODELS:
        return
    path = Path(model).expanduser()
    if path.exists() or not _looks_like_hub_id(model):
        readable_file(path, "--model", folder_ok=True)


def _looks_like_hub_id(model: str) -> bool:
    from tokenmill.models.loader import looks_like_hub_id  # the loader's rule; torch loads with the model anyway

    return looks_like_hub_id(model)


def batch_api_spec(args: argparse.Namespace) -> BatchApiSpec:
    """--endpoint URL --batch-api: the job goes through the server's Batch API."""
    from tokenmill.jobs.backends.batch_api import BatchApiSpec

    given = [name for name, dest in BATCH_API_ONLY_FLAGS.items() if getattr(args, dest) is not None]
    if not args.batch_api:
        raise ValueError(f"{', '.join(given)} need --batch-api")
    if not args.endpoint:
        raise ValueError("--batch-api submits the job to a server's Batch API: give it with --endpoint URL")
    if args.ray:
        raise ValueError("--batch-api leaves the work to the server's Batch API: it cannot run on --ray replicas")
    if len(args.endpoint) > 1:
        raise ValueError("--batch-api takes one --endpoint")
    if args.max_requests_per_minute is not None or args.max_tokens_per_minute is not None:
        raise ValueError("--max-requests-per-minute and --max-tokens-per-minute pace live requests; --batch-api "
                         "leaves the pace to the server's Batch API")
    return BatchApiSpec(args.endpoint[0], args.model, client_api_key(args.api_key), timeout_s=args.timeout,
                        retry_for_s=args.retry_for,
                        **_given(poll_s=args.poll_interval, max_requests_per_part=args.max_requests_per_part,
                                 max_bytes_per_part=args.max_bytes_per_part))


def _given(**values: Any) -> dict[str, Any]:
    """The flags given (not None): the rest keep the spec's own defaults, written there once."""
    return {name: value for name, value in values.items() if value is not None}


