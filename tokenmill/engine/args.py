"""`EngineConfig` as command-line flags, generated from its fields.

`tokenmill generate`, `run`, `serve` and `bench` all build their engine from these flags, so they
share names, defaults and help, and a new `EngineConfig` field is a new flag in each of them at
once (tests/engine/test_args.py holds every command to that).

A flag left out parses as None ("not set"), so `engine_settings` returns only what the user
gave (and what the command itself chose): the embedded engine fills the rest from
`EngineConfig`'s defaults, vLLM from its own (vllm_engine/config.py), and a flag given
explicitly always reaches the engine it was given for.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.sampling_params import StructuredOutputsParams
from tokenmill.engine.structured_outputs import check_grammar
from tokenmill.settings import add_setting_arguments, flag_of

_FIELDS_KEY = "engine_fields"  # where the namespace records which of its names are engine settings


def flag(name: str) -> str:
    """`max_num_seqs` → `--max-num-seqs`: an engine setting's flag, or one named like it (vLLM's)."""
    setting = next((f for f in fields(EngineConfig) if f.name == name), None)
    return flag_of(setting) if setting is not None else "--" + name.replace("_", "-")


def add_engine_arguments(
    parser: argparse.ArgumentParser,
    *,
    exclude: Iterable[str] = (),
    defaults: dict[str, Any] | None = None,
    help: dict[str, str] | None = None,
    title: str = "engine settings (EngineConfig)",
) -> None:
    """A flag for every `EngineConfig` field but those in `exclude` (which the command decides
    itself); `defaults` (the command's own choices, which count as set) and `help` replace a
    field's own default and help for this command."""
    group = parser.add_argument_group(title)
    names = add_setting_arguments(group, EngineConfig, exclude=exclude, defaults=defaults, help=help)
    parser.set_defaults(**{_FIELDS_KEY: tuple(names)})


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the command line set (flags given, and the command's own
    defaults), as keyword arguments for `EngineConfig` or `VllmConfig.from_settings`."""
    values = {name: getattr(args, name) for name in getattr(args, _FIELDS_KEY)}
    return {name: value for name, value in values.items() if value is not None}


# ---- structured outputs (`tokenmill generate` and `tokenmill run`) ------------------------------------
STRUCTURED_OUTPUT_FLAGS = {"json": "--json-schema", "choice": "--choice", "regex": "--regex"}


def add_structured_output_arguments(parser: argparse.ArgumentParser, title: str = "structured outputs") -> None:
    group = parser.add_argument_group(title).add_mutually_exclusive_group()
    group.add_argument("--json-schema", type=Path, metavar="FILE", help="answers are JSON following this JSON schema")
    group.add_argument("--choice", metavar="A,B,C", help="each answer is exactly one of these labels")
    group.add_argument("--regex", help="each answer matches this regular expression in full (Rust regex syntax)")


def structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The setting the flags ask for, checked to compile; ValueError naming the flag otherwise (a
    file that is missing or not JSON, an empty label, a schema or regex that does not compile)."""
    if args.json_schema is not None:
        try:
            setting = {"json": json.loads(args.json_schema.read_text())}
        except OSError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: cannot read it ({exc.strerror})") from None
        except ValueError as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({exc})") from None
    elif args.choice is not None:
        setting = {"choice": [label.strip() for label in args.choice.split(",")]}
    elif args.regex is not None:
        setting = {"regex": args.regex}
    else:
        return None
    try:
        so = StructuredOutputsParams(**setting)
        check_grammar(so)
    except ValueError as exc:
        message = str(exc)
        for kind, name in STRUCTURED_OUTPUT_FLAGS.items():
            message = message.replace(f"structured_outputs.{kind}", name)
        raise ValueError(message) from None
    return so
