"""``tokenmill serve``: argument parsing and wiring; the work is in app.py and engine_loop.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

API_KEY_ENV = "TOKENMILL_API_KEY"
DEFAULT_STATE_DIR = Path("~/.cache/tokenmill/serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", help="GGUF file, Hugging Face folder or hub id (default: embedded SmolLM2)")
    add("--served-model-name", help="the model id clients send (default: the GGUF file stem / folder name)")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000)
    add("--api-key", help=f"require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV})")
    add("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
        help=f"where Batch API files and batches are kept across restarts (default {DEFAULT_STATE_DIR})")
    add("--max-num-seqs", type=int, default=64, help="sequences in the running batch (default 64)")
    add("--max-model-len", type=int, help="context length (default: the model's)")
    add("--scheduling-policy", default="priority", choices=("fcfs", "priority", "length"),
        help="default priority: live requests go ahead of Batch API lines")
    add("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.engine.llm import LLM
    from tokenmill.jobs.embedded import model_name
    from tokenmill.serve.app import ServeState, create_app

    config = {"max_num_seqs": args.max_num_seqs, "scheduling_policy": args.scheduling_policy}
    if args.max_model_len:
        config["max_model_len"] = args.max_model_len
    llm = LLM(args.model, **config)
    state = ServeState(
        llm, model_name=args.served_model_name or model_name(args.model),
        state_dir=args.state_dir.expanduser(), api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
    )
    print(f"tokenmill serve: {state.model_name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    return 0
