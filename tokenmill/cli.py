"""`tokenmill` command line: a thin layer over the role packages, each of which owns its command's
arguments (`add_arguments`) and its entry point (`run`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence
from importlib.metadata import version

from tokenmill.settings import in_flags

# subcommand -> (the package that owns it, its one-line help)
_SUBCOMMANDS = {
    "generate": ("engine", "generate for a few prompts and report speed"),
    "plan": ("plan", "predict throughput, batch limits and cost on hardware"),
    "info": ("models", "what a model file or folder is: family, parameters, dtype, context, KV bytes/token, "
                       "whether tokenmill runs it"),
    "run": ("jobs", "run a batch job: JSONL in, OpenAI batch output out, resumable"),
    "serve": ("serve", "an OpenAI-compatible server (completions, chat, Batch API, metrics)"),
    "bench": ("bench", "benchmark throughput, latency and cost (`bench compare` files)"),
    "choose": ("choose", "the cheapest candidate whose quality on a sample of your job clears a bar"),
    "cascade": ("cascade", "the cheap tier answers every row; only answers that fail a check go on to the next tier"),
    "split": ("split", "cut a job's input into OpenAI Batch API files within the API's limits, to upload by hand"),
}


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` runs: its first item that names one (None for `--help`, `--version`, a
    typo)."""
    return next((item for item in argv if item in _SUBCOMMANDS), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line (`command` None), or one with only `command`'s arguments built: the
    other subcommands keep their name and help line (for `tokenmill --help` and the invalid-choice
    error) without importing their packages."""
    return _parser(_SUBCOMMANDS if command is None else [command])


def _parser(built: Collection[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Throughput-first batch LLM inference")
    parser.add_argument("--version", action="version", version=f"tokenmill {version('tokenmill')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (package, help_text) in _SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name in built:  # the others are never parsed: argv does not name them
            module = importlib.import_module(f"tokenmill.{package}.cli")
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = command_in(argv)
    args = _parser([] if command is None else [command]).parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenmill: error: {in_flags(exc, args)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path a command did not check (each checks its own first): a message, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"tokenmill: error: {where}{(exc.strerror or str(exc)).lower()}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
