"""`--engine` and the vLLM engine's flags, shared by `tokenmill run`, `serve`, `bench` and `choose`
candidates, and the one place the engine flags become an engine spec (`engine_spec`; an embedding
model's `EmbeddingConfig`: `embedding_spec`).

vLLM has a hundred engine arguments; they are not copied here one by one. The common ones have
flags, any other passes through `--engine-arg KEY=VALUE`, and tokenmill's own engine flags that
mean the same thing to vLLM (`--model`, `--dtype`, `--max-model-len`, `--max-num-seqs`, ...)
reach it whenever they are given (vllm_engine/config.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokenmill.embed.config import EmbeddingConfig
from tokenmill.engine import EngineConfig, EngineSpec
from tokenmill.engine.args import engine_settings, flag
from tokenmill.settings import flag_of, given_settings, settings_of
from tokenmill.vllm_engine.config import NAMED_ARGS, VllmConfig, VllmEmbeddingConfig, vllm_has

ENGINES = ("embedded", "vllm")
# The engine flags an embedding model takes (EmbeddingConfig's fields of the same names); the
# generation engine's others are refused by name with an embedding model.
EMBEDDING_ENGINE_SETTINGS = ("model", "max_model_len", "num_threads", "max_num_batched_tokens", "weight_format")


def add_engine_choice(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """--engine, and a flag group for vLLM's arguments. `several`: a comma-separated list (bench
    measures each engine on the same workload)."""
    if several:
        parser.add_argument("--engine", default=["embedded"], type=_engine_list, metavar="ENGINE[,ENGINE]",
                            help=f"engines to measure side by side, of {', '.join(ENGINES)} (default: embedded)")
    else:
        parser.add_argument("--engine", choices=ENGINES, default="embedded",
                            help="embedded (tokenmill's own) or vllm (vLLM in this process; pip install "
                            "'tokenmill[vllm]'); default embedded")
    group = parser.add_argument_group("the vLLM engine (--engine vllm; vLLM's own argument names)")
    for name, kind in NAMED_ARGS.items():
        group.add_argument(flag(name), dest=f"vllm_{name}", type=kind, help=f"vLLM {name}")
    group.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other vllm.EngineArgs field, repeatable; VALUE is read as JSON when it parses "
                       "(8, 0.9, true, {\"k\": 1}), else as text (e.g. --engine-arg enforce_eager=true)")


def _engine_list(value: str) -> list[str]:
    engines = [e.strip() for e in value.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines or len(set(engines)) != len(engines):
        raise argparse.ArgumentTypeError(f"expected a list of {', '.join(ENGINES)} without repeats, got {value!r}")
    return engines


def chosen_engines(args: argparse.Namespace) -> list[str]:
    return args.engine if isinstance(args.engine, list) else [args.engine]


def engine_spec(args: argparse.Namespace, engine: str | None = None, **overrides: Any) -> EngineSpec:
    """The engine the flags ask for (`engine`: one of a bench's list): `EngineConfig` with the
    engine flags that were set, or `VllmConfig` with those and vLLM's own. `overrides`: settings
    the command decides (bench's batch size). ValueError naming a flag the chosen engine cannot
    take: vLLM's flags without --engine vllm, an embedded-only setting with vLLM alone."""
    engines = chosen_engines(args)
    engine = engine or engines[0]
    settings = {**engine_settings(args), **overrides}
    if engine == "vllm":
        if "embedded" in engines:  # bench measuring both: the embedded-only flags were for the other one
            settings = {k: v for k, v in settings.items() if vllm_has(k)}
        named = {name: getattr(args, f"vllm_{name}") for name in NAMED_ARGS
                 if getattr(args, f"vllm_{name}") is not None}
        return VllmConfig.from_settings(settings, **named, engine_args=parse_engine_args(args.engine_arg))
    if "vllm" not in engines:
        given = [flag(name) for name in NAMED_ARGS if getattr(args, f"vllm_{name}") is not None]
        given += ["--engine-arg"] if args.engine_arg else []
        if given:
            raise ValueError(f"{', '.join(given)} need --engine vllm")
    return EngineConfig(**settings)


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


def embedding_spec(args: argparse.Namespace, refused: list[str] | None = None,
                   command_defaults: frozenset[str] = frozenset(),
                   engine: str | None = None) -> EmbeddingConfig | VllmEmbeddingConfig:
    """An embedding model in this process, from the engine flags it shares with the generation
    engine: tokenmill's embedder, or with --engine vllm vLLM's pooling runner (which takes vLLM's
    own flags too). The generation engine's other flags (and `refused`: the command's own that
    cannot apply) raise ValueError naming them, rather than being ignored. `command_defaults`:
    engine settings the command sets itself, not the user; `engine`: one of a bench's list."""
    given = engine_settings(args).keys() - set(EMBEDDING_ENGINE_SETTINGS) - command_defaults
    flags = [flag_of(f) for f in settings_of(EngineConfig) if f.name in given]
    flags += refused or []
    if flags:
        takes = [flag_of(f) for f in settings_of(EmbeddingConfig) if f.name in EMBEDDING_ENGINE_SETTINGS]
        raise ValueError(f"{', '.join(flags)}: not for an embedding model (it takes {', '.join(takes)})")
    settings = given_settings(args, EmbeddingConfig)
    if (engine or chosen_engines(args)[0]) != "vllm":
        return EmbeddingConfig(**settings)
    sort_window = settings.pop("sort_window", EmbeddingConfig.sort_window)
    own = [flag_of(f) for f in settings_of(EmbeddingConfig) if f.name in settings and not vllm_has(f.name)]
    if own:
        raise ValueError(f"{', '.join(own)}: tokenmill's embedder's, not vLLM's (--engine vllm takes vLLM's "
                         "flags and --engine-arg KEY=VALUE)")
    named = {name: getattr(args, f"vllm_{name}") for name in NAMED_ARGS if getattr(args, f"vllm_{name}") is not None}
    vllm = VllmConfig.from_settings(settings, **named, engine_args=parse_engine_args(args.engine_arg))
    return VllmEmbeddingConfig(vllm, sort_window)
