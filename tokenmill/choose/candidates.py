"""A candidate is a name and the `tokenmill run` flags it runs the sample with.

`--candidate 'local-choice=--choice positive,negative,mixed --price-per-hour 0.10'`: the flags are
parsed by `tokenmill run`'s own parser, so every engine, endpoint, structured-output and request
flag works as it does there, and nothing is written twice. Two flags of its own price a hosted API
by the token: `--price-per-m-input` and `--price-per-m-output`.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from tokenmill.choose.results import Price
from tokenmill.jobs import cli as run_cli
from tokenmill.jobs.backend import Backend
from tokenmill.jobs.config import JobConfig

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# `choose` decides these for every candidate: its sample, its folder, and starting afresh.
RESERVED = ("-o", "--output", "--errors", "--overwrite", "--input-format", "--strict", "--prompt-column",
            "--id-column")


class CandidateError(ValueError):
    """A --candidate that cannot be one; the message names it."""


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]  # its own flags, after the --flags every candidate shares
    common: tuple[str, ...]
    price: Price

    @property
    def flags_text(self) -> str:
        return shlex.join([*self.common, *self.flags])

    def run_args(self, sample: Path, output: Path, progress: bool = True) -> argparse.Namespace:
        """The parsed `tokenmill run` command line for this candidate's job."""
        argv = [str(sample), "-o", str(output), *self.common, *self.flags]
        if not progress:
            argv.append("--no-progress")
        return _parser(self.name).parse_args(argv)

    def job_config(self, sample: Path, output: Path, progress: bool = True) -> JobConfig:
        """Its job, as `tokenmill run` would build it from these flags, at the candidate's price."""
        config = run_cli.job_config(self.run_args(sample, output, progress))
        return JobConfig(**{**vars(config), "price_per_hour": self.price.per_hour})

    def backend(self, sample: Path, output: Path) -> Backend:
        """Its backend (loading a model waits for the backend's `start`, or its first `check`)."""
        return run_cli.make_backend(self.run_args(sample, output))

    def model(self) -> str | None:
        """The --model it names (None: the embedded default)."""
        return self.run_args(Path("sample.jsonl"), Path("out")).model


def parse_candidate(text: str, common: str = "", default_price_per_hour: float | None = None) -> Candidate:
    """`NAME=FLAGS` → a Candidate, its flags checked now (before anything runs)."""
    name, sep, flags_text = text.partition("=")
    name = name.strip()
    if not sep or not NAME.fullmatch(name):
        raise CandidateError(f"--candidate {text!r}: expected NAME=FLAGS, NAME of letters, digits, '.', '_' or "
                             "'-' (it names the candidate's folder), e.g. 'local=--price-per-hour 0.1'")
    try:
        flags, shared = tuple(shlex.split(flags_text)), tuple(shlex.split(common))
    except ValueError as exc:
        raise CandidateError(f"--candidate {name}: cannot split its flags: {exc}") from None
    for flag in (*shared, *flags):
        if flag.split("=", 1)[0] in RESERVED:
            raise CandidateError(f"--candidate {name}: {flag.split('=', 1)[0]} is set by choose for every "
                                 "candidate (its sample and its folder under -o)")
    args = _parser(name).parse_args(["sample.jsonl", "-o", "out", *shared, *flags])
    price = _price(name, args, default_price_per_hour)
    candidate = Candidate(name, flags, shared, price)
    try:
        run_cli.job_config(args)  # request flags (--choice, --template, …) checked before any run
    except ValueError as exc:
        raise CandidateError(f"--candidate {name}: {exc}") from None
    return candidate


def _price(name: str, args: argparse.Namespace, default_per_hour: float | None) -> Price:
    by_token = args.price_per_m_input is not None or args.price_per_m_output is not None
    per_hour = args.price_per_hour if args.price_per_hour is not None or by_token else default_per_hour
    try:
        return Price(per_hour, args.price_per_m_input, args.price_per_m_output)
    except ValueError as exc:
        raise CandidateError(f"--candidate {name}: {exc}") from None


class _FlagParser(argparse.ArgumentParser):
    """Errors name the candidate and raise, instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise CandidateError(f"{self.prog}: {message}")


def _parser(name: str) -> argparse.ArgumentParser:
    parser = _FlagParser(prog=f"--candidate {name}", add_help=False)
    run_cli.add_arguments(parser)
    prices = parser.add_argument_group("a price by the token (a hosted API), instead of --price-per-hour")
    prices.add_argument("--price-per-m-input", type=float, help="$ per million prompt tokens")
    prices.add_argument("--price-per-m-output", type=float, help="$ per million completion tokens")
    return parser
