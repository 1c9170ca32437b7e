"""Argument resolution, prices from the planner's catalog, planner compatibility, compare."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.bench.test_metrics import rec
from tokenmill.bench import cli
from tokenmill.bench.compare import run_compare
from tokenmill.bench.metrics import summarize
from tokenmill.bench.report import markdown, to_json, write_csv
from tokenmill.bench.runner import RunData, SweepConfig, SweepResult
from tokenmill.bench.workloads import LengthSpec, Workload
from tokenmill.plan.catalog import CATALOG
from tokenmill.plan.measured import load_measured


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_preset_and_overrides() -> None:
    wl, cfg = cli.resolve(parse("--preset", "seed-batch"))
    assert (wl.input.mean, wl.output.mean, cfg.batch_sizes, cfg.runs) == (2048, 512, [1, 8, 32, 64], 3)
    wl, cfg = cli.resolve(parse("--preset", "seed-batch", "--runs", "1", "--batch-sizes", "2"))
    assert (cfg.runs, cfg.batch_sizes, wl.input.mean) == (1, [2], 2048)
    assert parse("compare", "a.json", "b.json").files == [Path("a.json"), Path("b.json")]


def test_price_by_number_or_catalog() -> None:
    _, cfg = cli.resolve(parse("--price-per-hour", "0.10"))
    assert (cfg.price_per_hour, cfg.price_source) == (0.10, "--price-per-hour")
    _, cfg = cli.resolve(parse("--price-per-hour", "H200"))
    assert (cfg.price_per_hour, cfg.price_source) == (CATALOG["h200"].price_per_hour, "catalog H200")


def fake_result(label: str, price: float | None, speed: float) -> SweepResult:
    wl = Workload(LengthSpec(10), LengthSpec(4))
    result = SweepResult({"kind": "test"}, label, wl, SweepConfig([1, 2], runs=1, price_per_hour=price,
                         price_source="test"), {"cpu": "test"})
    for b in (1, 2):
        records = [rec(0.0, [i / speed for i in range(1, 5)]) for _ in range(b)]
        point = summarize(b, records, 4 / speed)
        result.points.append(point)
        result.runs[b] = [RunData(point, records, {})]
    return result


def test_json_is_read_by_the_planner(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(to_json(fake_result("a", 0.1, 10.0))))
    measured = load_measured(path)
    assert (measured.input_len, measured.output_len) == (10, 4)
    assert [p.batch_size for p in measured.points] == [1, 2]
    assert measured.points[1].output_tokens_per_s == pytest.approx(20.0)
    assert measured.points[0].decode_tokens_per_s is not None


def test_markdown_csv_and_costs(tmp_path: Path) -> None:
    data = to_json(fake_result("a", 0.1, 10.0))
    p2 = data["points"][1]
    assert p2["usd_per_m_output"] == pytest.approx(0.1 / (20 * 3600) * 1e6)
    assert p2["m_output_per_usd"] == pytest.approx(1 / p2["usd_per_m_output"])
    md = markdown(data)
    assert "In the shape of the published study" in md and "| 2 |" in md
    table = md.split("## Every point")[1].strip().splitlines()
    header, row = table[0].split("|"), table[3].split("|")
    assert len(header) == len(row), "every column of the points table has its cell"
    cells = dict(zip((h.strip() for h in header), (c.strip() for c in row), strict=True))
    assert cells["TTFT p50 ms"] == f"{p2['ttft_p50'] * 1000:,.1f}" and cells["E2E p95 s"] == f"{p2['e2e_p95']:,.2f}"
    write_csv(data["points"], tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text().splitlines()[0].startswith("batch_size,")


def test_compare_ranks_by_tokens_per_dollar(tmp_path: Path) -> None:
    files = []
    for label, price, speed in (("cheap-slow", 0.1, 10.0), ("dear-fast", 10.0, 100.0), ("no-price", None, 50.0)):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(to_json(fake_result(label, price, speed))))
        files.append(path)
    text = run_compare(files, tmp_path / "cmp")
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert "cheap-slow" in rows[0] and "dear-fast" in rows[1]
    assert (tmp_path / "cmp" / "compare-throughput.png").stat().st_size > 0
    with pytest.raises(ValueError, match="not a tokenmill bench"):
        (tmp_path / "x.json").write_text("{}")
        run_compare([tmp_path / "x.json"], None)


def test_compare_puts_each_batch_size_side_by_side_with_ratios(tmp_path: Path) -> None:
    """`bench --engine embedded,vllm` ends with this table: the first target over each other."""
    files = []
    for label, speed in (("fast (embedded)", 30.0), ("slow (vllm)", 20.0)):
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(to_json(fake_result(label, None, speed))))
        files.append(path)
    text = run_compare(files, None)
    table = text.split("## Side by side")[1]
    assert "| batch | fast (embedded) | slow (vllm) | ratio vs slow (vllm) |" in table
    assert "| 1 | 30.0 | 20.0 | 1.50× |" in table and "| 2 | 60.0 | 40.0 | 1.50× |" in table
