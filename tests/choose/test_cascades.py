"""A cascade as a `tokenmill choose` candidate, on a scripted endpoint whose answers, log-
probabilities and token counts are known: its quality and cost are exact, its threshold is
calibrated to the cheapest that clears, it is ranked and drawn beside the single candidates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cascade.test_cascade import COMPLETION, CONFIDENT, PROMPT, ROWS, answer, logprobs, truth
from tests.jobs.conftest import write_jsonl
from tests.jobs.stub_server import StubServer
from tokenmill.choose.stats import wilson
from tokenmill.cli import main


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"id": f"r{i}", "prompt": f"review {i}"} for i in range(ROWS)]
    expected = [{"custom_id": f"r{i}", "label": truth(i)} for i in range(ROWS)]
    return write_jsonl(tmp_path / "job.jsonl", rows), write_jsonl(tmp_path / "expected.jsonl", expected)


@pytest.fixture
def stub() -> Any:
    with StubServer(answer=answer, logprobs=logprobs) as server:
        yield server


def candidates(stub: StubServer, accept: str) -> list[str]:
    def tier(model: str, per_m_in: float, per_m_out: float) -> str:
        return (f"{model}=--endpoint {stub.url} --model {model} --retry-for 5 "
                f"--price-per-m-input {per_m_in} --price-per-m-output {per_m_out}")

    return ["--candidate", tier("cheap", 1, 2), "--candidate", tier("dear", 10, 20),
            "--candidate", f"cheap-then-dear=cascade:cheap,dear --accept {accept}"]


def choose(job: tuple[Path, Path], out: Path, *args: str) -> int:
    return main(["choose", str(job[0]), "--expected", str(job[1]), "-o", str(out), "--no-progress",
                 "--scorer", "label", "--clear-by", "mean", *args])


def by_name(out: Path) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads((out / "report.json").read_text())["candidates"]}


CHEAP_ROW = (PROMPT * 1 + COMPLETION * 2) / 1e6
DEAR_ROW = (PROMPT * 10 + COMPLETION * 20) / 1e6


def test_a_cascade_is_scored_on_its_tiers_answers_and_chosen_when_cheapest_to_clear(
        stub: StubServer, job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", "0.85", *candidates(stub, "min-logprob>=-1")) == 0
    found = by_name(out)
    cascade = found["cheap-then-dear"]
    # Rows 0-2 right at cheap, row 9 wrong but confident (kept at cheap), rows 3-8 on to dear (right).
    assert cascade["quality"]["mean"] == pytest.approx(0.9)
    assert (cascade["quality"]["low"], cascade["quality"]["high"]) == pytest.approx(wilson(9, 10))
    assert cascade["cascade"]["reached"] == [ROWS, ROWS - len(CONFIDENT)]
    assert cascade["projected"]["usd"] == pytest.approx(ROWS * CHEAP_ROW + 6 * DEAR_ROW, abs=1e-12)
    assert found["dear"]["projected"]["usd"] == pytest.approx(ROWS * DEAR_ROW, abs=1e-12)
    assert found["cheap"]["flags"].endswith("--logprobs 0")  # asked for what the check reads
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"]["chosen"] == "cheap-then-dear"  # cheap is below the bar, dear dearer
    assert "cheap-then-dear: 10 to cheap, 6 on to dear" in (out / "report.md").read_text()


@pytest.mark.parametrize(("bar", "threshold", "usd"), [
    (0.85, -0.1, ROWS * CHEAP_ROW + 6 * DEAR_ROW),  # the cheapest threshold that clears 0.85
    (0.25, -2.0, ROWS * CHEAP_ROW),  # every cheap answer kept already clears 0.25
])
def test_the_threshold_is_calibrated_to_the_cheapest_that_clears(stub: StubServer, job: Any, tmp_path: Path,
                                                                 bar: float, threshold: float, usd: float) -> None:
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", str(bar), *candidates(stub, "min-logprob")) == 0
    cascade = by_name(out)["cheap-then-dear"]
    assert cascade["cascade"]["calibrated"] == threshold
    assert cascade["cascade"]["accept"] == f"min-logprob>={threshold:g}"
    assert cascade["projected"]["usd"] == pytest.approx(usd, abs=1e-12)


def test_the_report_names_the_dominated_points(stub: StubServer, job: Any, tmp_path: Path) -> None:
    """The cheap model at twice the dear one's price is beaten by cheap itself (same answers, less
    cost); the cascade, cheap and dear are each best at some price."""
    out = tmp_path / "out"
    pricey = (f"pricey=--endpoint {stub.url} --model cheap --retry-for 5 --price-per-m-input 20 "
              "--price-per-m-output 40")
    assert choose(job, out, "--min-quality", "0.5", *candidates(stub, "min-logprob>=-1"), "--candidate", pricey) == 0
    md = (out / "report.md").read_text()
    assert "dominated (another is as cheap and as good): pricey (by cheap)" in md


@pytest.mark.parametrize(("cascade", "message"), [
    ("c=cascade:cheap,nope --accept parses", "no candidate named nope"),
    ("c=cascade:cheap --accept min-logprob", "at least two tiers"),
    ("c=cascade:cheap,dear", "give only --accept CHECK"),
    ("c=cascade:cheap,dear --accept margin>=1.5", "must be in [0, 1]"),
])
def test_bad_cascade_candidates_are_refused_before_any_run(job: Any, tmp_path: Path, capsys: Any, cascade: str,
                                                           message: str) -> None:
    code = choose(job, tmp_path / "out", "--min-quality", "0.5", "--candidate", "cheap=--price-per-hour 1",
                  "--candidate", "dear=--price-per-hour 2", "--candidate", cascade)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
