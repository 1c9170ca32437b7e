"""The published-study check: parsing, rounding-aware arithmetic, ceilings, claims.

The logic is tested on synthetic study text (so a row can be made impossible on purpose); the
real file is only required to parse and to be checked with the same rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.plan.catalog import CATALOG
from tokenmill.plan.errors import PlanError
from tokenmill.plan.model_specs import preset
from tokenmill.plan.roofline import make_plan, make_setup, memory_plan
from tokenmill.plan.study import (
    Deployment,
    Figure,
    Ratio,
    Study,
    check_study,
    implied_deployment,
    implied_usd_per_hour,
    load_study,
    markdown_tables,
    parse_figure,
    parse_study,
    row_inconsistencies,
    study_config,
)

HEADER = (
    "- Batch sizes (concurrent requests): 1, 8, 32, 64.\n"
    "- 2,048 input tokens and 512 output tokens per request.\n\n"
    "| model | B1 decode tok/s | B32 total tok/s | B32 per-request tok/s | B64 total tok/s "
    "| B64 gain vs B32 | $/M output (B32) | M tokens/$ |\n|---|---|---|---|---|---|---|---|\n")
GOOD_QWEN = "| Qwen2.5 7B | 97 | 2,810 | 88 | 3,280 | +17% | 0.18 | 5.56 |\n"


def study(rows: str = GOOD_QWEN, extra: str = "") -> Study:
    return parse_study(HEADER + rows + "\n" + extra)


@pytest.mark.parametrize(("text", "value", "half"), [
    ("2,810", 2810, 5),  # trailing zero read as rounding to tens
    ("97", 97, 0.5),
    ("0.18", 0.18, 0.005),
    ("+17%", 0.17, 0.005),
    ("5.56", 5.56, 0.005),
])
def test_parse_figure(text: str, value: float, half: float) -> None:
    fig = parse_figure(text)
    assert fig.value == pytest.approx(value)
    assert fig.half_unit == pytest.approx(half)


def test_missing_study_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"^study: cannot read .*missing\.md: No such file"):
        load_study(tmp_path / "missing.md")
    with pytest.raises(PlanError, match=r"^study: cannot read .*: Is a directory"):
        load_study(tmp_path)


def test_default_study_file_missing_points_at_the_option(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tokenmill.plan.study as study_module

    monkeypatch.setattr(study_module, "DEFAULT_STUDY", tmp_path / "batch-study.md")
    with pytest.raises(PlanError, match=r"--study-file PATH"):
        load_study()


def test_study_file_that_is_not_text(tmp_path: Path) -> None:
    (tmp_path / "s.md").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(PlanError, match=r"^study: .*s\.md is not UTF-8 text"):
        load_study(tmp_path / "s.md")


def test_parse_figure_rejects_text() -> None:
    with pytest.raises(PlanError, match=r"^study: not a number"):
        parse_figure("n/a")


def test_markdown_tables() -> None:
    text = "intro\n| a | b |\n|---|:-:|\n| 1 | 2 |\n| 3 | 4 |\n\n| x |\n|---|\n| y |\n"
    assert markdown_tables(text) == [[{"a": "1", "b": "2"}, {"a": "3", "b": "4"}], [{"x": "y"}]]


def test_protocol_is_parsed() -> None:
    s = study()
    assert (s.input_len, s.output_len, s.batch_sizes) == (2048, 512, (1, 8, 32, 64))


def test_missing_column_names_it() -> None:
    text = HEADER.replace("| B64 total tok/s ", "| B64 tok/s ") + GOOD_QWEN
    with pytest.raises(PlanError, match="b64 total tok/s"):
        parse_study(text)


def test_implied_dollars_per_hour() -> None:
    # $0.18/M x 2,810 tok/s x 3600 s / 1e6 = $1.82/hour
    assert implied_usd_per_hour(study().rows[0]).value == pytest.approx(1.82088)


def test_consistent_row_has_no_problems() -> None:
    # 88 x 32 = 2,816 ~ 2,810; 3,280/2,810 = +16.7% ~ +17%; 1/0.18 = 5.56
    assert row_inconsistencies(study().rows[0]) == []


@pytest.mark.parametrize(("row", "problem"), [
    ("| Qwen2.5 7B | 97 | 2,810 | 50 | 3,280 | +17% | 0.18 | 5.56 |", "per-request 50 x 32"),
    ("| Qwen2.5 7B | 97 | 2,810 | 88 | 3,280 | +30% | 0.18 | 5.56 |", "stated +30%"),
    ("| Qwen2.5 7B | 97 | 2,810 | 88 | 3,280 | +17% | 0.18 | 4.00 |", "1/($/M) = 5.56"),
])
def test_inconsistent_rows_are_flagged(row: str, problem: str) -> None:
    problems = row_inconsistencies(study(row + "\n").rows[0])
    assert len(problems) == 1 and problem in problems[0]


def test_deployment_is_the_smallest_that_holds_the_largest_batch() -> None:
    s = study()
    llama = preset("llama-3.1-70b")
    d = implied_deployment(llama, s)
    # 2xH100: 2 x 85.5 GB x 0.9 = 153.9 GB usable - 141.1 GB of bf16 weights leaves room for
    # 15 requests of 0.84 GB, not 64
    assert d == Deployment("h100-sxm", 4, "bf16")
    smaller = make_setup(llama, CATALOG["h100-sxm"], study_config(s, Deployment("h100-sxm", 2,
                                                                               "bf16")))
    assert memory_plan(smaller).max_batch < 64
    assert implied_deployment(llama, s, ("a100-80gb",)) == Deployment("a100-80gb", 4, "bf16")
    # DeepSeek-V3's 673 GB of fp8 weights exceed 8 x 85.5 GB x 0.9: only H200 nodes hold it
    assert implied_deployment(preset("deepseek-v3"), s) == Deployment("h200", 8, "fp8")


def test_ratios_are_measured_over_the_ceilings_of_the_implied_deployment() -> None:
    s = study()
    row = check_study(s).rows[0]
    assert row.deployment == Deployment("h100-sxm", 1, "bf16")
    plan = make_plan(preset("qwen2.5-7b"), CATALOG["h100-sxm"],
                     study_config(s, row.deployment, (1, 32)))
    assert row.b1 is not None and row.b32 is not None
    assert row.b1.of_decode == pytest.approx(97 / plan.points[0].decode_tokens_per_s)
    assert row.b32.of_e2e == pytest.approx(2810 / plan.points[1].e2e_tokens_per_s)
    assert row.impossible == []


def test_a_figure_above_the_ceiling_is_impossible() -> None:
    # 1xH100 reads Qwen2.5-7B's 14.1 GB of non-embedding weights in >= 4.2 ms: <= 235 tok/s
    row = check_study(study("| Qwen2.5 7B | 970 | 2,810 | 88 | 3,280 | +17% | 0.18 | 5.56 |\n"))
    assert row.rows[0].impossible == ["B1 decode"]


def test_rounding_gives_the_benefit_of_the_doubt() -> None:
    r = check_study(study()).rows[0].b1
    assert r is not None
    at_ceiling = Ratio(Figure(r.decode_ceiling + 0.4, 0.5), r.decode_ceiling, r.e2e_ceiling)
    assert not at_ceiling.impossible  # within the printed rounding of the ceiling
    above = Ratio(Figure(r.decode_ceiling + 1, 0.5), r.decode_ceiling, r.e2e_ceiling)
    assert above.impossible


def test_kv_claim_is_checked_by_computing_both_caches() -> None:
    rows = (GOOD_QWEN + "| Llama 3.1 70B | 22 | 580 | 18 | 620 | +7% | 0.79 | 1.27 |\n"
            "| Qwen2.5 72B | 26 | 690 | 22 | 730 | +6% | 0.82 | 1.22 |\n")
    extra = ('- Qwen2.5 72B is ~19% faster than Llama 3.1 70B at B32 "because of a smaller '
             'KV cache per request".\n')
    claims = {c.claim: c for c in check_study(study(rows, extra)).claims}
    kv = next(c for name, c in claims.items() if "smaller KV" in name)
    # both: 80 layers x 8 KV heads x 128 x 2 x 2 B = 327,680 B/token -> 800 MiB at 2,560
    assert kv.verdict == "false"
    assert "Qwen2.5-72B 800 MiB vs Llama-3.1-70B 800 MiB" in kv.detail


@pytest.mark.parametrize(("stated", "verdict"), [("1.16", "holds"), ("1.50", "inconsistent")])
def test_cost_example_arithmetic(stated: str, verdict: str) -> None:
    extra = (f"example: Llama 3 70B on 8×H100 at 6,000 tok/s aggregate and $25/hour → "
             f"about ${stated} per million output tokens.\n")
    claim = next(c for c in check_study(study(extra=extra)).claims if "Cost example" in c.claim)
    assert claim.verdict == verdict  # $25 / 21.6 M tokens = $1.157
    assert "$1.157/M" in claim.detail


@pytest.mark.parametrize(("stated", "verdict"), [("100", "holds"), ("10", "inconsistent")])
def test_prefix_caching_arithmetic(stated: str, verdict: str) -> None:
    extra = f"(a 1,000-token\n  prompt over 100,000 requests is {stated} M tokens of prefill)\n"
    claim = next(c for c in check_study(study(extra=extra)).claims if "Prefix" in c.claim)
    assert claim.verdict == verdict


def test_flat_implied_price_is_detected() -> None:
    # $/M x tok/s nearly constant across rows -> the table used one $/hour for every model
    rows = GOOD_QWEN + "| Phi-4 14B | 61 | 1,680 | 52 | 1,940 | +15% | 0.31 | 3.23 |\n"
    claim = next(c for c in check_study(study(rows)).claims if "$/hour" in c.claim)
    assert claim.verdict == "flat rate"
    rows = GOOD_QWEN + "| Phi-4 14B | 61 | 1,680 | 52 | 1,940 | +15% | 3.10 | 0.32 |\n"
    claim = next(c for c in check_study(study(rows)).claims if "$/hour" in c.claim)
    assert claim.verdict == "varies"


def test_published_study_file(study_file: Path) -> None:
    s = load_study(study_file)
    assert (s.input_len, s.output_len) == (2048, 512)
    assert len(s.rows) == len(s.kinds) == 7
    check = check_study(s)
    for r in check.rows:
        assert r.deployment is not None and r.plan is not None
        assert r.plan.memory.max_batch >= 64  # the deployment must run the study's B64
        for ratio in (r.b1, r.b32, r.b64):
            assert ratio is not None
            assert ratio.impossible == (ratio.measured.lo > ratio.decode_ceiling)
            assert ratio.e2e_ceiling < ratio.decode_ceiling
        assert r.implied_usd_per_hour.value == pytest.approx(
            r.row.usd_per_m.value * r.row.b32_total.value * 3600 / 1e6)


def test_cheapest_possible_deployment() -> None:
    row = check_study(study()).rows[0]
    assert row.cheapest is not None and row.deployment is not None
    assert row.cheapest.usd_per_hour <= row.deployment.usd_per_hour
    # nothing in the catalog decodes Qwen2.5-7B at a million tokens/s for one request
    absurd = "| Qwen2.5 7B | 1,000,000 | 2,810 | 88 | 3,280 | +17% | 0.18 | 5.56 |\n"
    assert check_study(study(absurd)).rows[0].cheapest is None
