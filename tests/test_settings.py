"""Settings: a library type's fields are its flags, and its refusals name fields — in Python the
field's name, on the command line the flag that set it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.jobs.backends import BatchApiSpec, EndpointSpec, RateLimit, RayOptions, RetryPolicy
from tokenmill.jobs.flags import SETTINGS_TYPES, add_arguments, parse_job
from tokenmill.jobs.input import DocumentOptions
from tokenmill.settings import (
    SettingError,
    add_setting_arguments,
    flag_of,
    given_settings,
    in_flags,
    setting,
    settings_of,
)

URL = "http://127.0.0.1:9/v1"


@dataclasses.dataclass(frozen=True)
class Knobs:
    width: int = setting(3, "how wide")
    fast: bool = setting(False, "go fast")
    label: str | None = setting(None, "a name", flag="--name", metavar="TEXT")
    hidden: int = 0  # not a setting: no flag

    def __post_init__(self) -> None:
        if self.width < 1:
            raise SettingError("{width} must be at least 1, got {got}", got=self.width)


def knobs_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser, Knobs)
    return parser


def test_a_flag_left_out_keeps_the_type_default() -> None:
    args = knobs_parser().parse_args([])
    assert given_settings(args, Knobs) == {} and Knobs(**given_settings(args, Knobs)) == Knobs()
    args = knobs_parser().parse_args(["--width", "5", "--fast", "--name", "x"])
    assert Knobs(**given_settings(args, Knobs)) == Knobs(width=5, fast=True, label="x")
    assert knobs_parser().parse_args(["--no-fast"]).fast is False  # given, even though it is the default
    assert "--hidden" not in knobs_parser().format_help()


def test_a_refusal_names_the_field_in_python_and_the_flag_on_the_command_line() -> None:
    with pytest.raises(SettingError) as caught:
        Knobs(width=0)
    assert str(caught.value) == "width must be at least 1, got 0" and caught.value.fields == ("width",)
    args = knobs_parser().parse_args(["--width", "0"])
    with pytest.raises(SettingError) as caught:
        Knobs(**given_settings(args, Knobs))
    assert in_flags(caught.value, args) == "--width must be at least 1, got 0"
    assert in_flags(ValueError("plain"), args) == "plain"


def test_a_setting_needs_help_and_unknown_names_are_refused() -> None:
    with pytest.raises(TypeError, match="needs its help"):
        setting(1)
    with pytest.raises(ValueError, match=r"not settings of Knobs: \['hidden'\]"):
        add_setting_arguments(argparse.ArgumentParser(), Knobs, only=("hidden",))


@pytest.mark.parametrize(("build", "words"), [
    (lambda: EndpointSpec(URL, concurrency=0), "concurrency must be positive, got 0"),
    (lambda: RateLimit(requests_per_minute=-5), "requests_per_minute must be positive, got -5"),
    (lambda: RetryPolicy(max_attempts=0), "max_attempts must be >= 1, got 0"),
    (lambda: RayOptions(replicas=0), "replicas must be"),
    (lambda: BatchApiSpec(URL, poll_s=0), "poll_s must be positive, got 0"),
    (lambda: DocumentOptions(max_tokens=0), "max_tokens must be positive, got 0"),
])
def test_library_types_speak_in_fields(build, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        build()
    assert str(caught.value).startswith(words) and "--" not in str(caught.value), caught.value


@pytest.mark.parametrize(("flags", "words"), [
    (["--endpoint", URL, "--concurrency", "0"], "--concurrency must be positive, got 0"),
    (["--endpoint", URL, "--max-requests-per-minute", "-5"], "--max-requests-per-minute must be positive, got -5"),
    (["--endpoint", URL, "--max-attempts", "0"], "--max-attempts must be >= 1, got 0"),
    (["--endpoint", URL, "--retry-for", "-1"], "--retry-for must be"),
    (["--endpoint", URL, "--batch-api", "--poll-interval", "0"], "--poll-interval must be positive, got 0"),
    (["--endpoint", URL, "--batch-api", "--retry-for", "-1"], "--retry-for must be"),
    (["--endpoint", "localhost:8000"], "--endpoint"),
    (["--max-tokens", "0"], "--max-tokens must be positive, got 0"),
    (["--part-rows", "0"], "--part-rows must be at least 1, got 0"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
])
def test_the_command_line_names_the_flag(flags: list[str], words: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    code = main(["run", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err


def test_every_job_setting_has_its_own_flag() -> None:
    """No two types share a field name (one namespace holds them all), and each flag reaches its
    field: given alone, it is what the command line hands that type."""
    names = [f.name for spec in SETTINGS_TYPES for f in settings_of(spec)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    for spec in SETTINGS_TYPES:
        for f in settings_of(spec):
            assert flag_of(f) in actions[f.name].option_strings, (spec.__name__, f.name)


def test_the_flags_build_the_types_they_set() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["in.jsonl", "-o", "out", "--endpoint", URL, "--concurrency", "3", "--timeout", "7",
                              "--retry-for", "9", "--max-tokens-per-minute", "600", "--order", "length-buckets",
                              "--no-progress", "--template", "Say {text}", "--part-rows", "10"])
    job, backend = parse_job(args)
    assert backend == EndpointSpec(URL, concurrency=3, timeout_s=7.0, retry=RetryPolicy(retry_for=9.0),
                                   rate_limit=RateLimit(tokens_per_minute=600.0), api_key=backend.api_key)
    assert (job.order, job.progress, job.part_rows) == ("length-buckets", False, 10)
    assert job.options == DocumentOptions(template="Say {text}")
