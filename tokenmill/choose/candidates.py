"""A candidate is a name and the `tokenmill run` flags it runs the sample with.

`--candidate 'local-choice=--choice positive,negative,mixed --price-per-hour 0.10'`: the flags are
parsed once, by `tokenmill run`'s own parser (jobs/flags.py), into the candidate's job settings and
backend spec, so every engine, endpoint, structured-output and request flag works as it does
there, and nothing is written twice. Two flags of its own price a hosted API by the token:
`--price-per-m-input` and `--price-per-m-output`.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NoReturn

from tokenmill.choose.results import Price
from tokenmill.jobs import JobConfig
from tokenmill.jobs import flags as run_flags
from tokenmill.jobs.backends import BackendSpec, RaySpec

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# `choose` decides these for every candidate: its sample, its folder, and starting afresh.
RESERVED = ("-o", "--output", "--errors", "--overwrite", "--input-format", "--strict", "--prompt-column",
            "--id-column")
# Stand-ins for the paths choose decides (RESERVED): the parser needs an input and an output.
_SAMPLE, _FOLDER = Path("sample.jsonl"), Path("candidate")


class CandidateError(ValueError):
    """A --candidate that cannot be one; the message names it."""


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]  # its own flags, after the --flags every candidate shares
    common: tuple[str, ...]
    price: Price
    job: JobConfig  # its job's settings, on stand-in paths (`job_config` puts in the real ones)
    backend: BackendSpec

    @property
    def flags_text(self) -> str:
        return shlex.join([*self.common, *self.flags])

    def job_config(self, sample: Path, output: Path, progress: bool = True) -> JobConfig:
        """Its job on `sample`, in `output`, at the candidate's price."""
        return replace(self.job, input=sample, output=output, price_per_hour=self.price.per_hour,
                       progress=progress and self.job.progress)

    def model(self) -> str | None:
        """The --model it names (None: the embedded default)."""
        spec = self.backend
        if isinstance(spec, RaySpec):
            spec = spec.replica
        if isinstance(spec, tuple):  # several endpoints: one --model
            spec = spec[0]
        return spec.model


def parse_candidate(text: str, common: str = "", default_price_per_hour: float | None = None,
                    flag: str = "--candidate", command: str = "choose") -> Candidate:
    """`NAME=FLAGS` → a Candidate, its flags parsed and checked now (before anything runs). `flag`
    and `command`, for the messages: `tokenmill cascade` parses its `--tier`s here too."""
    name, sep, flags_text = text.partition("=")
    name = name.strip()
    if not sep or not NAME.fullmatch(name):
        raise CandidateError(f"{flag} {text!r}: expected NAME=FLAGS, NAME of letters, digits, '.', '_' or "
                             "'-' (it names the candidate's folder), e.g. 'local=--price-per-hour 0.1'")
    try:
        flags, shared = tuple(shlex.split(flags_text)), tuple(shlex.split(common))
    except ValueError as exc:
        raise CandidateError(f"{flag} {name}: cannot split its flags: {exc}") from None
    for given in (*shared, *flags):
        if given.split("=", 1)[0] in RESERVED:
            raise CandidateError(f"{flag} {name}: {given.split('=', 1)[0]} is set by {command} for "
                                 "every one (its input and its folder under -o)")
    args = _parser(f"{flag} {name}").parse_args([str(_SAMPLE), "-o", str(_FOLDER), *shared, *flags])
    try:
        job, backend = run_flags.parse_job(args)
    except ValueError as exc:  # request flags (--choice, --template, …) and the backend's, before any run
        raise CandidateError(f"{flag} {name}: {exc}") from None
    return Candidate(name, flags, shared, _price(f"{flag} {name}", args, default_price_per_hour), job, backend)


def _price(who: str, args: argparse.Namespace, default_per_hour: float | None) -> Price:
    by_token = args.price_per_m_input is not None or args.price_per_m_output is not None
    per_hour = args.price_per_hour if args.price_per_hour is not None or by_token else default_per_hour
    try:
        return Price(per_hour, args.price_per_m_input, args.price_per_m_output)
    except ValueError as exc:
        raise CandidateError(f"{who}: {exc}") from None


class _FlagParser(argparse.ArgumentParser):
    """Errors name the candidate and raise, instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise CandidateError(f"{self.prog}: {message}")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = _FlagParser(prog=prog, add_help=False)
    run_flags.add_arguments(parser)
    prices = parser.add_argument_group("a price by the token (a hosted API), instead of --price-per-hour")
    prices.add_argument("--price-per-m-input", type=float, help="$ per million prompt tokens")
    prices.add_argument("--price-per-m-output", type=float, help="$ per million completion tokens")
    return parser
