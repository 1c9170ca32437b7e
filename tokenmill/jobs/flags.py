"""`tokenmill run`'s flags, and the one place they become typed objects: the job (`JobConfig`) and
its backend (`BackendSpec`, backend_specs.py). `tokenmill run` (jobs/cli.py) and each `tokenmill
choose` candidate parse their flags with these, so a flag means the same in both; below this,
nothing sees an argparse Namespace.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.embed.config import EmbeddingConfig, is_embedding_model
from tokenmill.engine.args import (
    add_engine_arguments,
    add_structured_output_arguments,
    structured_outputs_from_args,
)
from tokenmill.engines import EmbeddingSpec
from tokenmill.environment import NAMED_MODELS, client_api_key, readable_file
from tokenmill.jobs.backends import BatchApiSpec, EndpointSpec, RateLimit, RayOptions, RaySpec, RetryPolicy
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.storage import Location, location
from tokenmill.openai_compat import structured_outputs_body
from tokenmill.settings import add_setting_arguments, flag_of, given_settings, in_flags, name_flags, settings_of
from tokenmill.vllm_engine import args as vllm_args
from tokenmill.vllm_engine.args import EMBEDDING_ENGINE_SETTINGS, add_engine_choice, engine_spec

if TYPE_CHECKING:
    from tokenmill.jobs.backends.build import BackendSpec

# The job's own settings, by where --help lists them.
JOB_OUTPUT_SETTINGS = ("errors", "input_format", "output_format", "part_rows", "spool_dir")
JOB_RUNNING_SETTINGS = ("order", "strict", "overwrite", "price_per_hour", "progress")
CSV_SETTINGS = ("prompt_column", "id_column")
DOCUMENT_SETTINGS = ("system", "template", "max_tokens", "temperature", "completions", "embed")
# Every type a `tokenmill run` flag sets a field of (the engine's are engine/args.py's).
SETTINGS_TYPES = (JobConfig, DocumentOptions, EndpointSpec, RateLimit, RetryPolicy, BatchApiSpec, RayOptions)


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
    # The fields that flags set by hand (or that one flag sets in two types), as messages name them.
    name_flags(parser, input="the input", output="-o", url="--endpoint", retry_for_s="--retry-for")
    add_setting_arguments(parser, JobConfig, only=JOB_OUTPUT_SETTINGS)
    add_csv_column_arguments(parser)
    add_document_arguments(parser)
    add_setting_arguments(parser, DocumentOptions, only=("logprobs",))
    add_structured_output_arguments(
        parser, "structured outputs, for every row that asks for none of its own (docs/jobs.md)")
    ep = parser.add_argument_group("endpoint backend")
    ep.add_argument("--endpoint", action="append",
                    help="base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1; repeat it to "
                    "spread the rows over several servers, each taking the next row when it has a worker free "
                    "(a faster one takes more; with --ray, each batch goes to one of them)")
    for spec in (EndpointSpec, RateLimit, RetryPolicy):
        add_setting_arguments(ep, spec)
    add_batch_api_arguments(parser)
    add_setting_arguments(parser.add_argument_group("running"), JobConfig, only=JOB_RUNNING_SETTINGS)
    ray = parser.add_argument_group("scaling out on a Ray cluster (pip install 'tokenmill[ray]'; docs/jobs.md)")
    ray.add_argument("--ray", action="store_true", help="run the job data parallel on Ray, one engine per replica")
    add_setting_arguments(ray, RayOptions)
    add_engine_choice(parser)
    add_engine_arguments(parser, title="the embedded engine (EngineConfig; not used with --endpoint)", help={
        "model": "embedded: GGUF file, HF folder or hub id (default: the embedded SmolLM2; with --embed, "
                 "all-minilm-l6-v2), or an embedding model (a sentence-transformers / BERT folder, "
                 "all-minilm-l6-v2); with --endpoint: the model name sent in every body"})
    add_setting_arguments(parser.add_argument_group(
        "embedding models (with --embed or an embedding --model; --max-model-len, --num-threads, "
        "--max-num-batched-tokens and --weight-format fp32/q8 apply too)"), EmbeddingConfig,
        exclude=EMBEDDING_ENGINE_SETTINGS)


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    """How documents become requests (`tokenmill split` takes these too)."""
    docs = parser.add_argument_group("turning documents into requests (and filling request bodies)")
    add_setting_arguments(docs, DocumentOptions, only=DOCUMENT_SETTINGS)


def add_batch_api_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("half-price batches through the endpoint's Batch API (docs/jobs.md)")
    group.add_argument("--batch-api", action="store_true",
                       help="with --endpoint: submit the job through its Batch API (/v1/files + /v1/batches; "
                       "OpenAI bills batches at half price) instead of live requests, and wait for the batches")
    add_setting_arguments(group, BatchApiSpec)


def add_csv_column_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("CSV input (.csv, .tsv, or --input-format csv): the other columns are "
                                      "kept as each row's metadata")
    add_setting_arguments(group, DocumentOptions, only=CSV_SETTINGS)


def parse_job(args: argparse.Namespace) -> tuple[JobConfig, BackendSpec]:
    """The job and the backend the flags ask for; JobError naming the flag for any that cannot be."""
    try:
        return job_config(args), backend_spec(args)
    except JobError:
        raise
    except ValueError as exc:
        raise JobError(in_flags(exc, args)) from None


def job_config(args: argparse.Namespace) -> JobConfig:
    """The job the flags ask for (`tokenmill choose` builds each candidate's job here too)."""
    documents = given_settings(args, DocumentOptions)
    if not args.endpoint and is_embedding_model(args.model):
        documents["embed"] = True  # an embedding model's documents can only be embedded
    options = DocumentOptions(model=args.model if args.endpoint else None,
                              structured_outputs=_structured_outputs(args), **documents)
    return JobConfig(input=_input(args), output=args.output, options=options, **given_settings(args, JobConfig))


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


def _given_flags(args: argparse.Namespace, spec: type) -> list[str]:
    """The flags of `spec`'s settings that the command line gave."""
    return [flag_of(f) for f in settings_of(spec) if getattr(args, f.name, None) is not None]


def backend_spec(args: argparse.Namespace) -> BackendSpec:
    """The backend the flags ask for: the embedded engine, vLLM's, an endpoint, or Ray replicas of
    any of them. ValueError naming the flag for a combination that cannot be."""
    if args.batch_api or _given_flags(args, BatchApiSpec):
        return batch_api_spec(args)
    urls = args.endpoint or []
    if urls and args.engine == "vllm":
        raise ValueError("--engine vllm runs vLLM in this process; --endpoint sends to a server instead: give one")
    pacing = _given_flags(args, RateLimit)
    if pacing and not urls:
        raise ValueError(f"{' and '.join(pacing)} pace an --endpoint: give one")
    ray_flags = _given_flags(args, RayOptions)
    if ray_flags and not args.ray:
        raise ValueError(f"{', '.join(ray_flags)} need --ray")
    if urls:
        endpoints = tuple(_endpoint_spec(args, url) for url in urls)
    else:
        check_model_path(args.model)
        if args.embed or is_embedding_model(args.model):
            return embedding_spec(args)
    engine = None if urls else engine_spec(args)
    if not args.ray:
        if urls:  # several: one process spreads the rows over them (endpoint.py)
            return endpoints[0] if len(endpoints) == 1 else endpoints
        return engine  # type: ignore[return-value]
    return RaySpec(endpoints if urls else engine, RayOptions(**given_settings(args, RayOptions)))  # type: ignore[arg-type]


def embedding_spec(args: argparse.Namespace) -> EmbeddingSpec:
    """An embedding model in this process, tokenmill's or vLLM's (Ray replicas do not embed yet:
    --ray is refused)."""
    spec = vllm_args.embedding_spec(args, ["--ray"] if args.ray else [])
    model = args.model
    hub_id = model is not None and not Path(model).expanduser().exists() and _looks_like_hub_id(model)
    if model is not None and not hub_id and not is_embedding_model(model):  # a hub id's config tells, at load
        raise ValueError(f"--embed: --model {model} is not an embedding model (a sentence-transformers or BERT "
                         "folder, or all-minilm-l6-v2)")
    return spec


def _endpoint_spec(args: argparse.Namespace, url: str) -> EndpointSpec:
    return EndpointSpec(url, args.model, client_api_key(args.api_key),
                        retry=RetryPolicy(**given_settings(args, RetryPolicy)),
                        rate_limit=RateLimit(**given_settings(args, RateLimit)),
                        **given_settings(args, EndpointSpec, exclude=("api_key",)))


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
    if not args.batch_api:
        raise ValueError(f"{', '.join(_given_flags(args, BatchApiSpec))} need --batch-api")
    if not args.endpoint:
        raise ValueError("--batch-api submits the job to a server's Batch API: give it with --endpoint URL")
    if args.ray:
        raise ValueError("--batch-api leaves the work to the server's Batch API: it cannot run on --ray replicas")
    if len(args.endpoint) > 1:
        raise ValueError("--batch-api takes one --endpoint")
    if pacing := _given_flags(args, RateLimit):
        raise ValueError(f"{' and '.join(pacing)} pace live requests; --batch-api leaves the pace to the "
                         "server's Batch API")
    # The endpoint's --timeout and --retry-for hold for the control calls too.
    shared = {name: value for name, value in (("timeout_s", args.timeout_s), ("retry_for_s", args.retry_for))
              if value is not None}
    return BatchApiSpec(args.endpoint[0], args.model, client_api_key(args.api_key), **shared,
                        **given_settings(args, BatchApiSpec))
