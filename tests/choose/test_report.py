"""The outputs of `tokenmill choose` (tokenmill/choose/report.py): table, Markdown, JSON, PNG (checked
by what its figure draws)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.text import Annotation
from rich.console import Console

from tokenmill.choose.report import (
    figure,
    format_duration,
    log_scale,
    markdown,
    pareto_front,
    plot,
    print_report,
    short_model,
    write_reports,
)
from tokenmill.choose.results import (
    FAILED,
    CandidateResult,
    Ceiling,
    ChooseReport,
    Price,
    Projection,
    Quality,
)
from tokenmill.choose.stats import decide

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def candidates() -> list[CandidateResult]:
    return [
        CandidateResult(
            name="local-choice", flags="--model /models/Qwen2.5-7B-Instruct-Q4_K_M.gguf --max-tokens 8",
            price=Price(per_hour=2.0), backend="embedded", model="/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf",
            rows=100, answered=99, failed=1, quality=Quality(0.93, 0.91, 0.95, "wilson", 100),
            prompt_tokens=20_000, output_tokens=5_000, output_tok_s=1234.5, prefill_tok_s=45678.9,
            usd_per_m_output=0.4504,
            projected=Projection(rows=10_000, prompt_tokens=2_000_000, output_tokens=500_000, wall_s=5400.0, usd=3.0),
            ceiling=Ceiling(hardware="H100", batch_size=64, output_tok_s=5000.0, usd_per_m_output=0.15, job_usd=1.1),
        ),
        CandidateResult(
            name="local-free", flags="--model SmolLM2-360M", price=Price(per_hour=0.5), backend="embedded",
            model="HuggingFaceTB/SmolLM2-360M-Instruct", rows=100, answered=100,
            quality=Quality(0.85, 0.77, 0.91, "wilson", 100), notes={"no label": 3, "wrong label": 12},
            output_tok_s=3000.0, prefill_tok_s=90000.0, usd_per_m_output=0.0463,
            projected=Projection(rows=10_000, prompt_tokens=2_000_000, output_tokens=500_000, wall_s=45.0, usd=0.0063),
        ),
        CandidateResult(
            name="api-mystery", flags="--endpoint http://api.example/v1", price=Price(), backend="endpoint",
            model="org/big-model", rows=100, answered=100, quality=Quality(0.95, 0.89, 0.98, "wilson", 100),
            output_tok_s=800.0,
            projected=Projection(rows=10_000, prompt_tokens=2_000_000, output_tokens=500_000, wall_s=1200.0, usd=None),
        ),
        CandidateResult(
            name="broken", flags="--model nowhere", price=Price(per_m_input=0.1, per_m_output=0.4),
            status=FAILED, reason="model not found | 404", rows=100,
        ),
    ]


@pytest.fixture
def report() -> ChooseReport:
    cands = candidates()
    return ChooseReport(job="jobs/labels.jsonl", job_rows=10_000, sample=100, seed=7, scorer="exact",
                        candidates=cands, verdict=decide(cands, 0.9, "lower"), hardware="H100",
                        warnings=["3 rows have no expected answer and were left out of the sample"])


def test_markdown_has_each_row_formatted(report: ChooseReport) -> None:
    md = markdown(report)
    assert md.startswith("# tokenmill choose: jobs/labels.jsonl\n")
    assert "A random sample of 100 of the job's 10,000 rows (seed 7), scored by `exact`; " \
           "the bar: 0.90 by its lower bound." in md
    assert ("| candidate | model | price | quality | rows | out tok/s | prefill tok/s | $/M out | projected time "
            "| projected $ | ceiling $/M on H100 | status |") in md
    assert ("| local-choice | Qwen2.5-7B-Instruct-Q4_K_M.gguf | $2/h | 0.93 [0.91, 0.95] | 99/100 (1 failed) "
            "| 1,234.5 | 45,679 | $0.45 | 1.5 h | $3.00 | $0.15 | done |") in md
    assert ("| local-free | SmolLM2-360M-Instruct | $0.5/h | 0.85 [0.77, 0.91] | 100/100 | 3,000.0 | 90,000 "
            "| $0.046 | 45 s | $0.0063 | – | done |") in md
    assert ("| api-mystery | big-model | unknown | 0.95 [0.89, 0.98] | 100/100 | 800.0 | – | – | 20.0 min | – "
            "| – | done |") in md
    # The pipe in the reason is escaped, or it would split the cell.
    assert ("| broken | – | $0.1/M in · $0.4/M out | – | 0/100 | – | – | – | – | – | – "
            "| failed: model not found \\| 404 |") in md


def test_markdown_has_the_verdict_notes_flags_and_warnings(report: ChooseReport) -> None:
    md = markdown(report)
    assert ("**Verdict:** local-choice: the cheapest that clears 0.90 by its lower bound (0.93 [0.91, 0.95]); "
            "whole job $3.00 projected.") in md
    assert "local-free, api-mystery straddle the bar: sample more" in md
    assert "Wilson for pass/fail scores, bootstrap for graded ones); failed rows count as 0." in md
    assert "ceiling = the planner's bound for that hardware, not a measurement." in md
    assert "- local-free: 12 wrong label, 3 no label" in md
    assert "- local-choice: `--model /models/Qwen2.5-7B-Instruct-Q4_K_M.gguf --max-tokens 8`" in md
    assert "- 3 rows have no expected answer and were left out of the sample" in md


def test_without_hardware_there_is_no_ceiling_column(report: ChooseReport) -> None:
    report.hardware = None
    assert "ceiling" not in markdown(report).split("**Verdict:**")[0]


def as_json_reads(value: Any) -> Any:
    """What JSON makes of a value: tuples come back as lists."""
    if isinstance(value, dict):
        return {k: as_json_reads(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json_reads(v) for v in value]
    return value


def test_write_reports_writes_the_three_files(report: ChooseReport, tmp_path: Path) -> None:
    paths = write_reports(report, tmp_path / "out")
    assert paths == {"markdown": tmp_path / "out/report.md", "json": tmp_path / "out/report.json",
                     "png": tmp_path / "out/report.png"}
    assert paths["markdown"].read_text() == markdown(report)
    data = json.loads(paths["json"].read_text())
    assert data == as_json_reads(report.to_json())
    assert data["verdict"]["chosen"] == "local-choice"
    assert data["candidates"][0]["ceiling"]["hardware"] == "H100"
    assert paths["png"].read_bytes().startswith(PNG_MAGIC)  # what it shows: the tests of `figure`


def test_the_plot_draws_each_candidate_at_its_cost_and_quality(report: ChooseReport) -> None:
    fig = figure(report)
    (ax,) = fig.axes
    (points,) = ax.containers  # one errorbar series: there is no cascade here
    assert points.get_label() == "candidate"
    dots, _, (intervals,) = points.lines
    # The two finished candidates with a known cost, at (projected $, mean quality), in their order.
    np.testing.assert_allclose(dots.get_xydata(), [[3.0, 0.93], [0.0063, 0.85]])
    np.testing.assert_allclose(intervals.get_segments(), [[[3.0, 0.91], [3.0, 0.95]], [[0.0063, 0.77], [0.0063, 0.91]]])
    assert [(t.get_text(), t.xy) for t in ax.texts if isinstance(t, Annotation)] == [
        ("local-choice", (3.0, 0.93)), ("local-free", (0.0063, 0.85))]
    lines = {line.get_label(): line for line in ax.lines}
    # Neither beats the other (the cheaper is worse): both are on the front, cheapest first.
    np.testing.assert_allclose(lines["Pareto front"].get_xydata(), [[0.0063, 0.85], [3.0, 0.93]])
    (steps,) = [line for line in ax.lines if line.get_drawstyle() == "steps-post"]
    np.testing.assert_allclose(steps.get_xydata(), [[0.0063, 0.85], [3.0, 0.93]])
    np.testing.assert_allclose(lines["chosen: local-choice"].get_xydata(), [[3.0, 0.93]])
    assert [0.9, 0.9] in [list(line.get_ydata()) for line in ax.lines]  # the bar, across the axes
    assert " bar 0.90" in [t.get_text() for t in ax.texts]
    assert ax.get_xscale() == "log"  # $0.0063 .. $3: more than 10x
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["Pareto front", "chosen: local-choice",
                                                                   "candidate"]
    assert [t.get_text() for t in fig.texts] == ["not plotted (cost unknown: api-mystery; did not finish: broken)"]


def test_plot_with_nothing_to_plot_still_draws(report: ChooseReport, tmp_path: Path) -> None:
    report.candidates = [c for c in report.candidates if c.name in ("api-mystery", "broken")]
    (ax,) = figure(report).axes
    assert not ax.containers and [list(line.get_ydata()) for line in ax.lines] == [[0.9, 0.9]]  # the bar only
    assert "no finished candidate with a known cost" in [t.get_text() for t in ax.texts]
    assert plot(report, tmp_path / "deep/empty.png").read_bytes().startswith(PNG_MAGIC)


def test_the_cost_axis_is_logarithmic_only_across_more_than_ten_times() -> None:
    assert log_scale([0.0063, 3.0])
    assert not log_scale([1.0, 10.0])
    assert not log_scale([0.0, 3.0])  # a free candidate cannot sit on a log axis
    assert not log_scale([])


def test_print_report_renders_the_table_and_the_verdict(report: ChooseReport) -> None:
    report.candidates[0].name = "[bold]local-choice"  # the user's names are not markup
    console = Console(record=True, width=200)
    print_report(report, console)
    text = console.export_text()
    assert "tokenmill choose · 100 of 10,000 rows · scorer exact · bar 0.90 by lower bound" in text
    assert "ceiling $/M on H100" in text
    for expected in ("[bold]local-choice", "0.93 [0.91, 0.95]", "0.85 [0.77, 0.91]", "99/100 (1 failed)",
                     "failed: model", "1.5 h", "$0.0063"):
        assert expected in text
    assert "warning: 3 rows have no expected answer" in text
    assert "local-free: 12 wrong label, 3 no label" in text
    assert "straddle the bar: sample more" in text


@pytest.mark.parametrize(("points", "front"), [
    ([], []),
    ([("only", 1.0, 0.5)], ["only"]),
    # c is beaten by b (cheaper and better); d by a (as cheap, worse).
    ([("c", 3.0, 0.6), ("b", 2.0, 0.7), ("a", 1.0, 0.5), ("d", 1.0, 0.4)], ["a", "b"]),
    ([("y", 1.0, 0.5), ("x", 1.0, 0.5)], ["x", "y"]),  # equal points beat neither
    ([("dear", 2.0, 0.5), ("cheap", 1.0, 0.5)], ["cheap"]),
    ([("best", 5.0, 0.99), ("mid", 2.0, 0.9), ("low", 0.5, 0.6)], ["low", "mid", "best"]),
])
def test_pareto_front(points: list[tuple[str, float, float]], front: list[str]) -> None:
    assert pareto_front(points) == front


def test_small_formats() -> None:
    assert [format_duration(s) for s in (None, 4.24, 45.0, 750.0, 11_520.0)] == [
        "–", "4.2 s", "45 s", "12.5 min", "3.2 h"]
    assert (short_model("/models/x.gguf"), short_model("org/name/"), short_model("")) == ("x.gguf", "name", "–")
