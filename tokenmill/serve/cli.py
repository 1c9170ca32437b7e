"""``tokenmill serve``: flags → an engine spec (the embedded engine, or vLLM's with --engine vllm),
or an embedding model's settings → the loaded model behind the OpenAI routes; the work is in
app.py, engine_loop.py and embeddings.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.embed.config import is_embedding_model
from tokenmill.engine.args import add_engine_arguments
from tokenmill.environment import SERVER_API_KEY_ENV, cache_root, model_name, server_api_key
from tokenmill.serve.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_UPLOAD_BYTES
from tokenmill.vllm_engine.args import add_engine_choice, embedding_spec, engine_spec

if TYPE_CHECKING:
    from tokenmill.embed.inputs import EmbeddingInputs
    from tokenmill.engine import InProcessModel
    from tokenmill.engines import EmbeddingSpec

# Live requests go ahead of Batch API lines under "priority" (vLLM schedules by it too).
ENGINE_DEFAULTS = {"scheduling_policy": "priority"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--served-model-name", help="the model id clients send (default: the GGUF file stem / folder name)")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000)
    add("--api-key", help=f"require 'Authorization: Bearer KEY' on every route but /health "
        f"(default: ${SERVER_API_KEY_ENV})")
    state_dir = cache_root() / "serve"
    add("--state-dir", type=Path, default=state_dir,
        help=f"where Batch API files and batches are kept across restarts (default {state_dir})")
    add("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest JSON request body (and line of an uploaded batch file); larger is a 413. Default "
        f"{DEFAULT_MAX_REQUEST_BYTES} (10 MiB): a full-context prompt is a few MB, so only what would tie "
        "the server up is refused")
    add("--max-upload-bytes", type=int, default=DEFAULT_MAX_UPLOAD_BYTES,
        help=f"largest file for POST /v1/files; larger is a 413. Default {DEFAULT_MAX_UPLOAD_BYTES} (200 MiB): "
        "OpenAI takes Batch API input files up to 200 MB")
    add("--max-tokens-limit", type=_positive_int, metavar="N",
        help="refuse (400, naming this limit) a request asking for more than N tokens (max_tokens or "
        "max_completion_tokens), live or a Batch API line; one asking for none gets the default held to N. "
        "Default: no limit but the context")
    add("--no-docs", dest="docs", action="store_false",
        help="serve no /docs, /redoc or /openapi.json (with --api-key they need the key too)")
    add("--log-level", default="info")
    add_engine_choice(parser)
    add_engine_arguments(parser, defaults=ENGINE_DEFAULTS, help={
        "model": "GGUF file, HF folder or hub id (default: the embedded SmolLM2), or an embedding model (a "
                 "sentence-transformers / BERT folder, all-minilm-l6-v2): it answers /v1/embeddings instead"})


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.serve.app import create_app
    from tokenmill.serve.state import ServeState, hold_state_dir

    state_dir = args.state_dir.expanduser()
    with hold_state_dir(state_dir):
        llm = _load_model(args)
        state = ServeState(
            llm, model_name=args.served_model_name or model_name(args.model), state_dir=state_dir,
            api_key=server_api_key(args.api_key), max_request_bytes=args.max_request_bytes,
            max_upload_bytes=args.max_upload_bytes, docs=args.docs, max_tokens_limit=args.max_tokens_limit,
        )
        print(f"tokenmill serve: {state.model_name} on http://{args.host}:{args.port}/v1", flush=True)
        try:
            uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
        finally:
            # vLLM's engine process goes with the server, not at interpreter exit
            if state.loop:
                state.loop.engine.close()
            if state.embeddings:
                state.embeddings.embedder.close()
    return 0


def _load_model(args: argparse.Namespace) -> InProcessModel | EmbeddingInputs:
    from tokenmill.engines import load_embedder, load_engine

    if is_embedding_model(args.model):
        return load_embedder(_embedding_config(args))

    return load_engine(engine_spec(args))


def _embedding_config(args: argparse.Namespace) -> EmbeddingSpec:
    """An embedding model's settings; --max-tokens-limit, a generation limit, is refused by name."""
    refused = ["--max-tokens-limit"] if args.max_tokens_limit is not None else []
    return embedding_spec(args, refused, command_defaults=frozenset(ENGINE_DEFAULTS))
