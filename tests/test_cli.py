"""The `tokenmill` command itself (each subcommand is tested beside its package)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from tokenmill.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenmill {version('tokenmill')}"  # pyproject.toml's


# Each command that prices its results, with the arguments it needs to parse.
PRICED = {
    "generate": ["a prompt"],
    "run": ["in.jsonl", "-o", "out"],
    "bench": ["--batch-sizes", "1"],
    "choose": ["job.jsonl", "--expected", "e.jsonl", "-o", "out", "--candidate", "a=--max-tokens 4",
               "--min-quality", "0.8"],
    "plan": ["--model", "llama-3.1-8b", "--hardware", "h100-sxm"],
}


@pytest.mark.parametrize("command", PRICED)
def test_every_command_takes_a_price_or_a_hardware_name(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli import build_parser
    from tokenmill.plan.catalog import CATALOG

    def price(value: str) -> float:
        given = build_parser().parse_args([command, *PRICED[command], "--price-per-hour", value]).price_per_hour
        return getattr(given, "usd", given)  # bench keeps where the price came from, for its reports

    assert price("H200") == CATALOG["h200"].price_per_hour and price("0.25") == 0.25
    for bad in ("tpu-v9", "-1"):
        with pytest.raises(SystemExit):
            price(bad)
    err = capsys.readouterr().err
    assert "argument --price-per-hour: 'tpu-v9' is neither a number nor a catalog hardware (known: a100-80gb" in err
    assert "argument --price-per-hour: must be a finite number >= 0, got -1" in err
