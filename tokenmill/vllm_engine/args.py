"""`--engine` and the vLLM engine's flags, shared by `tokenmill run`, `bench` and `choose` candidates.

vLLM has a hundred engine arguments; they are not copied here one by one. The common ones have
flags, any other passes through `--engine-arg KEY=VALUE`, and tokenmill's own engine flags that
mean the same thing to vLLM (`--model`, `--max-model-len`, `--max-num-seqs`, ...) are passed on
when they are set away from the embedded engine's defaults (otherwise vLLM's own defaults hold:
the embedded engine's fp32 and batch of 64 suit a CPU, not a GPU).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from tokenmill.engine import EngineConfig

ENGINES = ("embedded", "vllm")
# EngineConfig fields that are vllm.EngineArgs fields of the same name and meaning.
SHARED_SETTINGS = ("tokenizer", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                   "enable_prefix_caching", "enable_chunked_prefill", "block_size", "seed")
# The vLLM arguments with a flag of their own (the rest: --engine-arg).
NAMED_ARGS = {"tensor_parallel_size": int, "pipeline_parallel_size": int, "gpu_memory_utilization": float,
              "quantization": str}


def add_engine_choice(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """--engine, and a flag group for vLLM's arguments. `several`: a comma-separated list (bench
    measures each engine on the same workload)."""
    if several:
        parser.add_argument("--engine", default="embedded", type=_engine_list, metavar="ENGINE[,ENGINE]",
                            help=f"engines to measure side by side, of {', '.join(ENGINES)} (default: embedded)")
    else:
        parser.add_argument("--engine", choices=ENGINES, default="embedded",
                            help="embedded (tokenmill's own) or vllm (vLLM in this process; pip install "
                            "'tokenmill[vllm]'); default embedded")
    group = parser.add_argument_group("the vLLM engine (--engine vllm; vLLM's own argument names)")
    for name, kind in NAMED_ARGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=f"vllm_{name}", type=kind, help=f"vLLM {name}")
    group.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other vllm.EngineArgs field, repeatable; VALUE is read as JSON when it parses "
                       "(8, 0.9, true, {\"k\": 1}), else as text (e.g. --engine-arg enforce_eager=true)")


def _engine_list(value: str) -> list[str]:
    engines = [e.strip() for e in value.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines or len(set(engines)) != len(engines):
        raise argparse.ArgumentTypeError(f"expected a list of {', '.join(ENGINES)} without repeats, got {value!r}")
    return engines


def uses_vllm(args: argparse.Namespace) -> bool:
    engine = args.engine
    return "vllm" in engine if isinstance(engine, list) else engine == "vllm"


def check_engine_flags(args: argparse.Namespace) -> None:
    """vLLM's flags without --engine vllm are a mistake, not something to ignore; so is a weight
    format asked of vLLM alone (it loads the weights its own way)."""
    if uses_vllm(args):
        engines = args.engine if isinstance(args.engine, list) else [args.engine]
        chosen, default = getattr(args, "weight_format", None), _default("weight_format")
        if "embedded" not in engines and chosen not in (None, default):
            raise ValueError(f"--weight-format {chosen} is the embedded engine's setting; vLLM loads the weights "
                             "its own way (--quantization, --dtype)")
        return
    given = [f"--{name.replace('_', '-')}" for name in NAMED_ARGS if getattr(args, f"vllm_{name}") is not None]
    given += ["--engine-arg"] if args.engine_arg else []
    if given:
        raise ValueError(f"{', '.join(given)} need --engine vllm")


def vllm_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """vllm.EngineArgs keywords from the flags (the model aside: `VllmLLM` resolves --model): the
    shared settings set away from the embedded defaults, the named flags, then --engine-arg."""
    engine_args: dict[str, Any] = {}
    for name in SHARED_SETTINGS:
        value = getattr(args, name, None)
        if value is not None and value != _default(name):
            engine_args[name] = value
    for name in NAMED_ARGS:
        if getattr(args, f"vllm_{name}") is not None:
            engine_args[name] = getattr(args, f"vllm_{name}")
    engine_args.update(parse_engine_args(args.engine_arg))
    return engine_args


def _default(setting: str) -> Any:
    return next(f.default for f in fields(EngineConfig) if f.name == setting)


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        parsed[key.strip().replace("-", "_")] = value
    return parsed
