"""`tokenmill bench compare a.json b.json ...`: side by side, ranked by tokens per dollar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.bench.report import fmt, md_table, plot_sweep, study_row


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"compare: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != "tokenmill-bench/1":
        raise ValueError(f"compare: {path} is not a tokenmill bench JSON file")
    data.setdefault("label", path.stem)
    return data


def best_point(data: dict[str, Any]) -> dict[str, Any]:
    """The point with the most output tokens per dollar (per second when there is no price)."""
    return max(data["points"], key=lambda p: (p.get("m_output_per_usd") or 0, p["output_tokens_per_s"]))


def ranked(datasets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Priced runs first, by M output tokens/$; then unpriced ones by raw throughput.
    def key(d: dict[str, Any]) -> tuple[int, float]:
        p = best_point(d)
        return (1 if p.get("m_output_per_usd") else 0, p.get("m_output_per_usd") or p["output_tokens_per_s"])

    return sorted(datasets, key=key, reverse=True)


def compare_rows(datasets: list[dict[str, Any]]) -> list[dict[str, str]]:
    rows = []
    for rank, d in enumerate(ranked(datasets), 1):
        p = best_point(d)
        price = d["sweep"].get("price_per_hour")
        rows.append({
            "rank": str(rank), "target": d["label"], "in/out": f"{d['input_len']}/{d['output_len']}",
            "$/h": fmt(price, "{:g}"), "best batch": str(p["batch_size"]),
            "out tok/s": fmt(p["output_tokens_per_s"], "{:,.1f}"),
            "per-req tok/s": fmt(p["per_request_output_tokens_per_s"], "{:,.2f}"),
            "TTFT p50 ms": fmt(p["ttft_p50"], "ms"), "TPOT p50 ms": fmt(p["tpot_p50"], "ms"),
            "$/M out": fmt(p.get("usd_per_m_output"), "{:,.3f}"),
            "M out/$": fmt(p.get("m_output_per_usd"), "{:,.2f}"),
        })
    return rows


def side_by_side_rows(datasets: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each batch size every file measured: each target's output tok/s and the first target's
    ratio to each of the others (`bench --engine embedded,vllm`: embedded over vLLM)."""
    by_batch = [{p["batch_size"]: p for p in d["points"]} for d in datasets]
    common = sorted(set.intersection(*(set(b) for b in by_batch)))
    labels = [d["label"] for d in datasets]
    if len(set(labels)) < len(labels):  # the same model twice: number them
        labels = [f"{i + 1}. {label}" for i, label in enumerate(labels)]
    rows = []
    for batch in common:
        rates = [b[batch]["output_tokens_per_s"] for b in by_batch]
        row = {"batch": str(batch)} | {label: f"{rate:.1f}" for label, rate in zip(labels, rates, strict=True)}
        for label, rate in zip(labels[1:], rates[1:], strict=True):
            row[f"ratio vs {label}"] = f"{rates[0] / rate:.2f}×" if rate else "–"
        rows.append(row)
    return rows


def run_compare(paths: list[Path], out: Path | None) -> str:
    if len(paths) < 1:
        raise ValueError("compare: give at least one bench JSON file")
    datasets = [load(p) for p in paths]
    shapes = {(d["input_len"], d["output_len"]) for d in datasets}
    text = "# tokenmill bench compare\n\n" + md_table(compare_rows(datasets)) + "\n\n"
    text += "## In the shape of the published study\n\n" + md_table([study_row(d) for d in datasets]) + "\n"
    if len(datasets) > 1:
        text += "\n## Side by side, per batch size (output tok/s; ratio: the first over each other)\n\n"
        text += md_table(side_by_side_rows(datasets)) + "\n"
    if len(shapes) > 1:
        text += "\nWarning: the files used different input/output lengths; their numbers are not comparable.\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(text)
        plot_sweep(datasets, out, prefix="compare-")
    return text
