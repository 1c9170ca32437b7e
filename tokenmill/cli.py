"""`tokenmill` command line: a thin layer over the engine and the planner."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

_SUBCOMMANDS = {
    "plan": "predict throughput, batch limits and cost on hardware",
    "run": "run a batch job: JSONL in, OpenAI batch output out, resumable",
    "serve": "an OpenAI-compatible server (completions, chat, Batch API, metrics)",
    "bench": "benchmark throughput, latency and cost (`bench compare` files)",
}
_PACKAGES = {"run": "jobs"}  # subcommand -> package, where the names differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Throughput-first batch LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_generate(commands.add_parser("generate", help="generate for a few prompts and report speed"))
    for name, help_text in _SUBCOMMANDS.items():
        # Each role's package owns its arguments; imported here so the CLI stays thin.
        module = importlib.import_module(f"tokenmill.{_PACKAGES.get(name, name)}.cli")
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    p.add_argument("--file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--model", help="GGUF file, Hugging Face folder or hub id (default: embedded SmolLM2)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--price-per-hour", type=float, help="hardware $/hour, to print the cost per token")
    p.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.file:
        prompts += [line.strip() for line in args.file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass them as arguments or with --file")
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    start = time.monotonic()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    wall = time.monotonic() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n>>> {prompt}\n{out.text.strip()}  [{out.finish_reason}, {out.num_output_tokens} tokens]")
    _print_summary(outputs, wall, args.price_per_hour)
    return 0


def _print_summary(outputs: list, wall: float, price_per_hour: float | None) -> None:
    prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    output_tokens = sum(o.num_output_tokens for o in outputs)
    rate = output_tokens / wall
    print(
        f"\n{len(outputs)} requests · {prompt_tokens} prompt tokens ({cached} from prefix cache) · "
        f"{output_tokens} output tokens · {wall:.2f} s · {rate:.1f} output tok/s · "
        f"{(prompt_tokens + output_tokens) / wall:.1f} total tok/s"
    )
    if price_per_hour is not None:
        per_million = price_per_hour / (rate * 3600) * 1e6
        print(
            f"at ${price_per_hour:.2f}/hour: ${per_million:.2f} per million output tokens · "
            f"{1 / per_million:.2f} M output tokens per $"
        )


if __name__ == "__main__":
    raise SystemExit(main())
