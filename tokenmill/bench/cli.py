"""`tokenmill bench` arguments and entry point (wired into `tokenmill.cli` like `plan`/`run`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tokenmill.bench.runner import SweepConfig, run_sweep
from tokenmill.bench.workloads import DISTRIBUTIONS, LengthSpec, Workload
from tokenmill.embed.config import is_embedding_model
from tokenmill.engine import EngineSpec
from tokenmill.engine.args import add_engine_arguments
from tokenmill.environment import CLIENT_API_KEY_ENV, client_api_key
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import hourly_price_arg
from tokenmill.vllm_engine import add_engine_choice, engine_spec
from tokenmill.vllm_engine.args import embedding_spec

# The protocol of the published batch-throughput study (docs/bench.md, batch-study.md).
PRESETS: dict[str, dict[str, Any]] = {
    "seed-batch": {"batch_sizes": "1,8,32,64", "input_len": 2048, "output_len": 512, "runs": 3},
}
DEFAULTS: dict[str, Any] = {"batch_sizes": "1,8,32", "input_len": 128, "output_len": 32, "runs": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mode", nargs="?", choices=["run", "compare"], default="run",
                   help="run a sweep (default) or compare bench JSON files")
    p.add_argument("files", nargs="*", type=Path, help="compare: bench JSON files")
    t = p.add_argument_group("target")
    t.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    t.add_argument("--endpoint-model", help="model name to send (default: the first of /v1/models)")
    t.add_argument("--api-key", help=f"bearer token for the endpoint (default: ${' or $'.join(CLIENT_API_KEY_ENV)})")
    t.add_argument("--tokenizer", help="tokenizer for building endpoint prompts (HF id/folder or .gguf; "
                   "default: the embedded model's)")
    t.add_argument("--plain-openai", action="store_true",
                   help="endpoint: do not send min_tokens / ignore_eos (strict OpenAI servers)")
    w = p.add_argument_group("workload")
    w.add_argument("--preset", choices=sorted(PRESETS), help="seed-batch: batch 1,8,32,64, 2048 in / 512 out, 3 runs")
    w.add_argument("--input-len", type=int, help=f"input tokens (mean for distributions; {DEFAULTS['input_len']})")
    w.add_argument("--output-len", type=int, help=f"output tokens, enforced ({DEFAULTS['output_len']})")
    w.add_argument("--input-dist", choices=DISTRIBUTIONS, default="fixed")
    w.add_argument("--output-dist", choices=DISTRIBUTIONS, default="fixed")
    w.add_argument("--input-spread", type=float, default=0.5, help="uniform: +/- fraction; lognormal: sigma")
    w.add_argument("--output-spread", type=float, default=0.5)
    w.add_argument("--prefix-len", type=int, default=0, help="shared-prefix workload: prefix tokens")
    w.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix workload: distinct prefixes")
    w.add_argument("--prompts", type=Path, help="JSONL of real prompts (prompt / messages / prompt_token_ids)")
    s = p.add_argument_group("sweep")
    s.add_argument("--batch-sizes", help=f"comma-separated ({DEFAULTS['batch_sizes']})")
    s.add_argument("--runs", type=int, help=f"runs per batch size, median reported ({DEFAULTS['runs']})")
    s.add_argument("--num-requests", type=int, help="requests per run (default: the batch size)")
    s.add_argument("--warmup", type=int, default=2, help="warm-up requests, not counted (2)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--price-per-hour", type=hourly_price_arg, help=PRICE_HELP)
    s.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (bench-results/)")
    # The sweep sets max_num_seqs (the largest batch size); --seed above seeds the workload; --tokenizer
    # above builds endpoint prompts.
    add_engine_choice(p, several=True)
    add_engine_arguments(p, exclude=("max_num_seqs", "seed", "tokenizer"),
                         title="the embedded engine (EngineConfig; not used with --endpoint)")


def run(args: argparse.Namespace) -> int:
    if args.mode == "compare":
        from tokenmill.bench.compare import run_compare

        print(run_compare(args.files, args.out))
        return 0
    if args.files:
        raise ValueError(f"bench: unexpected arguments {[str(f) for f in args.files]} (did you mean compare?)")
    if args.endpoint and args.engine != ["embedded"]:
        raise ValueError("bench: --engine measures engines in this process; --endpoint measures a server: give one")
    if not args.endpoint and is_embedding_model(args.model):
        return run_embedding_bench(args)
    workload, cfg = resolve(args)
    specs = {engine: engine_spec(args, engine, max_num_seqs=max(cfg.batch_sizes)) for engine in args.engine}
    from tokenmill.bench.report import terminal, to_json, write_all

    files = []
    for engine in args.engine:  # one after another, each freed before the next loads
        out = args.out / engine if len(args.engine) > 1 else args.out
        target = endpoint_target(args) if args.endpoint else engine_target(specs[engine])
        try:
            result = run_sweep(target, workload, cfg, log=lambda m: print(m, file=sys.stderr))
        finally:
            getattr(target, "close", lambda: None)()
        paths = write_all(result, out)
        terminal(to_json(result))
        print("wrote " + " · ".join(str(p) for p in paths.values()))
        files.append(paths["json"])
    if len(files) > 1:
        from tokenmill.bench.compare import run_compare

        print(run_compare(files, args.out))
    return 0


# Workload flags of a generation bench, which an embedding model's refuses rather than ignores.
_GENERATION_ONLY = {"output_len": "--output-len", "prefix_len": "--prefix-len", "prompts": "--prompts",
                    "preset": "--preset", "num_requests": "--num-requests"}


def run_embedding_bench(args: argparse.Namespace) -> int:
    """An embedding model: inputs/s and tokens/s by batch size and length mix (bench/embeddings.py),
    for each --engine in turn."""
    from tokenmill.bench import embeddings
    from tokenmill.engines import load_embedder

    given = [flag for name, flag in _GENERATION_ONLY.items() if getattr(args, name)]
    if given:
        raise ValueError(f"{', '.join(given)}: not for an embedding model (its bench takes --batch-sizes, "
                         "--input-len/--input-dist/--input-spread, --runs, --price-per-hour)")
    specs = {engine: embedding_spec(args, engine=engine) for engine in args.engine}  # every flag checked first
    mixes = (embeddings.MIXES if args.input_len is None
             else {"custom": LengthSpec(args.input_len, args.input_dist, args.input_spread)})
    batches = (embeddings.BATCH_SIZES if args.batch_sizes is None else
               tuple(int(b) for b in args.batch_sizes.split(",") if b.strip()))
    price, measured = args.price_per_hour, []
    for engine, spec in specs.items():
        embedder = load_embedder(spec)
        try:
            data = embeddings.run_embedding_sweep(
                embedder, f"{embedder.name} ({engine})", mixes, batches, args.runs or DEFAULTS["runs"], args.seed,
                None if price is None else price.usd, None if price is None else price.source,
                log=lambda m: print(m, file=sys.stderr))
        finally:
            embedder.close()
        paths = embeddings.write_reports(data, args.out / engine if len(specs) > 1 else args.out)
        embeddings.terminal(data)
        print("wrote " + " · ".join(str(p) for p in paths.values()))
        measured.append(data)
    if len(measured) > 1:
        table = embeddings.compare(measured)
        (args.out / "compare.md").write_text(table + "\n")
        print(table)
    return 0


def _pick(args: argparse.Namespace, name: str) -> Any:
    explicit = getattr(args, name)
    if explicit is not None:
        return explicit
    return PRESETS.get(args.preset or "", {}).get(name, DEFAULTS[name])


def resolve(args: argparse.Namespace) -> tuple[Workload, SweepConfig]:
    try:
        batches = [int(b) for b in str(_pick(args, "batch_sizes")).split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"batch-sizes: expected integers like 1,8,32, got {args.batch_sizes!r}") from None
    inp = LengthSpec(_pick(args, "input_len"), args.input_dist, args.input_spread)
    out = LengthSpec(_pick(args, "output_len"), args.output_dist, args.output_spread)
    name = "jsonl" if args.prompts else "shared-prefix" if args.prefix_len else (
        "fixed" if inp.dist == out.dist == "fixed" else "distribution")
    if args.prefix_len and args.prefix_len >= inp.mean:
        raise ValueError(f"prefix-len: {args.prefix_len} must be below input-len {inp.mean}")
    workload = Workload(inp, out, args.prefix_len, args.num_prefixes, args.prompts, args.preset or name)
    price = args.price_per_hour  # an HourlyPrice: the reports say which catalog entry priced them
    cfg = SweepConfig(batches, _pick(args, "runs"), args.num_requests, args.warmup, args.seed,
                      None if price is None else price.usd, None if price is None else price.source, args.preset)
    return workload, cfg


def endpoint_target(args: argparse.Namespace) -> Any:
    from tokenmill.bench.endpoint import EndpointTarget

    return EndpointTarget(args.endpoint, load_tokenizer(args.tokenizer), args.endpoint_model,
                          client_api_key(args.api_key), args.plain_openai)


def engine_target(spec: EngineSpec) -> Any:
    """The engine `spec` asks for, loaded, as a bench target labelled by model and engine (and the
    embedded engine's weight format when it is not the default: fp32 and q4 runs are compared)."""
    from tokenmill.bench.embedded import EmbeddedTarget
    from tokenmill.engines import load_engine
    from tokenmill.environment import embedded_model_path

    llm = load_engine(spec)
    label = f"{spec.model or embedded_model_path().stem} ({spec.engine}"
    weights = llm.engine.describe().get("weight_format_resolved", "auto")
    return EmbeddedTarget(llm, label + (")" if weights == "auto" else f", {weights})"), kind=spec.engine)


def load_tokenizer(source: str | None) -> Any:
    from tokenmill.models import loader

    tok = loader.load_tokenizer(source)
    if tok is None:
        raise ValueError(f"tokenizer: could not load one from {source or 'the embedded model'}")
    return tok
