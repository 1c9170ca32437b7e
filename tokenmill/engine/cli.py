"""``tokenmill generate``: a few prompts through the offline `LLM` API, with their speed and cost."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.cost import millions_per_usd, usd_per_million
from tokenmill.engine.args import (
    add_engine_arguments,
    add_structured_output_arguments,
    engine_settings,
    structured_outputs_from_args,
)
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.sampling_params import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, SamplingParams
from tokenmill.plan.price import FLAG_HELP as PRICE_HELP
from tokenmill.plan.price import price_per_hour_arg

if TYPE_CHECKING:
    from tokenmill.engine.interface import RequestOutput


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompts", nargs="*", help="prompts (or use --file)")
    p.add_argument("--file", type=Path, help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy (default {DEFAULT_TEMPERATURE:g}, OpenAI's, as in `run` and `serve`)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="sampling seed, the same for every prompt")
    p.add_argument("--price-per-hour", type=price_per_hour_arg, help=f"to print the cost per token: {PRICE_HELP}")
    add_structured_output_arguments(p)
    # The engine's own seed is left out: --seed above already seeds every prompt of this command.
    add_engine_arguments(p, exclude=("seed",))


def run(args: argparse.Namespace) -> int:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line.strip() for line in args.file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass them as arguments or with --file")
    structured_outputs = structured_outputs_from_args(args)
    from tokenmill.engine.llm import LLM  # here: `generate --help` loads no torch

    llm = LLM.from_config(EngineConfig(**engine_settings(args)))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        structured_outputs=structured_outputs,
    )
    start = time.monotonic()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    wall = time.monotonic() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        answer = f"refused: {out.error}" if out.error else out.text.strip()
        print(f"\n>>> {prompt[:200]}\n{answer}  [{out.finish_reason}, {out.num_output_tokens} tokens]")
    _print_summary(outputs, wall, args.price_per_hour)
    return 1 if any(out.error for out in outputs) else 0  # the others were still answered


def _print_summary(outputs: list[RequestOutput], wall: float, price_per_hour: float | None) -> None:
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
        print(
            f"at ${price_per_hour:.2f}/hour: ${_two(usd_per_million(price_per_hour, rate))} per million output "
            f"tokens · {_two(millions_per_usd(price_per_hour, rate))} M output tokens per $"
        )


def _two(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"
