"""Bench outputs: terminal table, Markdown (the published study's shape), JSON, CSV, PNG plots."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench.runner import SweepResult
from tokenmill.cost import millions_per_usd, usd_per_million

# (key, header, format) for the per-point tables; times in the JSON are seconds, shown in ms.
COLUMNS: list[tuple[str, str, str]] = [
    ("batch_size", "batch", "{:d}"),
    ("output_tokens_per_s", "out tok/s", "{:,.1f}"),
    ("per_request_output_tokens_per_s", "per-req tok/s", "{:,.2f}"),
    ("prefill_tokens_per_s", "prefill tok/s", "{:,.0f}"),
    ("decode_tokens_per_s", "decode tok/s", "{:,.1f}"),
    ("requests_per_s", "req/s", "{:,.3f}"),
    # Headers must be unique: rows are dicts keyed by header.
    ("ttft_p50", "TTFT p50 ms", "ms"), ("ttft_p95", "TTFT p95 ms", "ms"), ("ttft_p99", "TTFT p99 ms", "ms"),
    ("tpot_p50", "TPOT p50 ms", "ms"), ("tpot_p95", "TPOT p95 ms", "ms"),
    ("e2e_p50", "E2E p50 s", "{:,.2f}"), ("e2e_p95", "E2E p95 s", "{:,.2f}"),
    ("gain", "gain", "pct"),
    ("peak_kv_usage", "peak KV", "pct0"), ("preemptions", "preempt", "{:d}"),
    ("shape", "in/out actual", "str"),
    ("usd_per_m_output", "$/M out", "{:,.3f}"), ("m_output_per_usd", "M out/$", "{:,.2f}"),
    ("usd_per_m_total", "$/M total", "{:,.4f}"), ("m_total_per_usd", "M total/$", "{:,.1f}"),
]


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if spec == "ms":
        return f"{value * 1000:,.1f}"
    if spec == "pct":
        return f"{value:+.0%}"
    if spec == "pct0":
        return f"{value:.0%}"
    if spec == "str":
        return str(value)
    return spec.format(value)


def point_dict(point: Any, price: float | None) -> dict[str, Any]:
    """A point with its costs and the shape check, as written to JSON/CSV (planner keys included)."""
    d = asdict(point)
    d["shape"] = f"{d['input_len_mean']:.0f}/{d['output_len_mean']:.0f}"
    for name, tps in (("output", d["output_tokens_per_s"]), ("total", d["total_tokens_per_s"])):
        d[f"usd_per_m_{name}"] = usd_per_million(price, tps) if price is not None else None
        d[f"m_{name}_per_usd"] = millions_per_usd(price, tps) if price is not None else None
    return d


def to_json(result: SweepResult) -> dict[str, Any]:
    """Everything, with `input_len`, `output_len` and `points` on top: `tokenmill plan
    --measured` reads this file as it is."""
    cfg, wl = result.config, result.workload
    price = cfg.price_per_hour
    return {
        "format": "tokenmill-bench/1",
        "label": result.label,
        "input_len": wl.input.mean if wl.jsonl is None else _mean_actual(result, "input_len_mean"),
        "output_len": wl.output.mean,
        "points": [point_dict(p, price) for p in result.points],
        "target": result.target,
        "workload": wl.describe(),
        "sweep": {k: v for k, v in asdict(cfg).items()},
        "environment": result.environment,
        "warnings": result.warnings,
        "runs": {str(b): [{"point": point_dict(r.point, price), "extra": r.extra,
                           "records": [asdict(rec) for rec in r.records]} for r in runs]
                 for b, runs in result.runs.items()},
    }


def _mean_actual(result: SweepResult, key: str) -> int:
    values = [getattr(p, key) for p in result.points if getattr(p, key)]
    return max(1, round(sum(values) / len(values))) if values else 1


def write_all(result: SweepResult, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data = to_json(result)
    paths = {"json": out / "bench.json", "md": out / "report.md", "csv": out / "points.csv"}
    paths["json"].write_text(json.dumps(data, indent=1))
    paths["md"].write_text(markdown(data))
    write_csv(data["points"], paths["csv"])
    paths |= plot_sweep([data], out)
    return paths


def write_csv(points: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0]) if points else ["batch_size"])
        writer.writeheader()
        writer.writerows(points)


def study_row(data: dict[str, Any]) -> dict[str, str]:
    """The published study's columns: decode at batch 1; total and per-request at 32 (or the
    largest batch below it); gain to the next batch; $/M output and M tokens/$ at that batch."""
    by_batch = {p["batch_size"]: p for p in data["points"]}
    ref_b = 32 if 32 in by_batch else max(by_batch)
    ref = by_batch[ref_b]
    nxt = next((by_batch[b] for b in sorted(by_batch) if b > ref_b), None)
    b1 = by_batch.get(1)
    return {
        "target": data["label"],
        "B1 decode tok/s": fmt(b1 and b1["decode_tokens_per_s"], "{:,.1f}"),
        f"B{ref_b} total tok/s": fmt(ref["output_tokens_per_s"], "{:,.1f}"),
        f"B{ref_b} per-request tok/s": fmt(ref["per_request_output_tokens_per_s"], "{:,.2f}"),
        "next batch total tok/s": (f"B{nxt['batch_size']}: " + fmt(nxt["output_tokens_per_s"], "{:,.1f}"))
        if nxt else "–",
        "gain vs ref": fmt(nxt and nxt["gain"], "pct") if nxt else "–",
        f"$/M output (B{ref_b})": fmt(ref["usd_per_m_output"], "{:,.3f}"),
        "M tokens/$": fmt(ref["m_output_per_usd"], "{:,.2f}"),
    }


def md_table(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r[h] for h in head) + " |" for r in rows]
    return "\n".join(lines)


def point_rows(points: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{header: fmt(p.get(key), spec) for key, header, spec in COLUMNS} for p in points]


def markdown(data: dict[str, Any]) -> str:
    wl, sweep, env = data["workload"], data["sweep"], data["environment"]
    price = sweep["price_per_hour"]
    lines = [
        f"# tokenmill bench: {data['label']}",
        "",
        f"Workload `{wl['name']}`: input {_spec(wl['input'])}, output {_spec(wl['output'])} tokens"
        + (f", shared prefix {wl['prefix_len']} x {wl['num_prefixes']}" if wl["prefix_len"] else "")
        + f"; {sweep['runs']} run(s) per batch size, median; {sweep['warmup']} warm-up request(s).",
        f"Price: {_price(price, sweep['price_source'])}."
        f" Machine: {env.get('cpu')} x{env.get('cpu_count')}, {env.get('cuda') or 'no GPU'};"
        f" torch {env.get('torch')}; {env.get('created_utc')}.",
        "",
        "## In the shape of the published study",
        "",
        md_table([study_row(data)]),
        "",
        "## Every point",
        "",
        md_table(point_rows(data["points"])),
        "",
    ]
    if data["warnings"]:
        lines += ["## Warnings", "", *[f"- {w}" for w in data["warnings"]], ""]
    return "\n".join(lines)


def _price(price: float | None, source: str | None) -> str:
    return "none given" if price is None else f"${price:g}/h ({source})"


def _spec(spec: dict[str, Any]) -> str:
    return str(spec["mean"]) if spec["dist"] == "fixed" else f"{spec['dist']}(mean {spec['mean']}, {spec['spread']})"


def terminal(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmill bench · {data['label']}")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in point_rows(data["points"]):
        table.add_row(*row.values())
    Console().print(table)


def plot_sweep(datasets: list[dict[str, Any]], out: Path, prefix: str = "") -> dict[str, Path]:
    """Three PNGs: throughput vs batch size, the latency/throughput frontier, TTFT/TPOT."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    paths = {k: out / f"{prefix}{k}.png" for k in ("throughput", "frontier", "latency")}
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in datasets:
        pts = d["points"]
        ax.plot([p["batch_size"] for p in pts], [p["output_tokens_per_s"] for p in pts], "o-", label=d["label"])
    ax.set_xscale("log", base=2)
    _finish(ax, "batch size (concurrent requests)", "output tokens/s (total)", "Throughput vs batch size")
    fig.savefig(paths["throughput"], dpi=110, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in datasets:
        pts = [p for p in d["points"] if p["per_request_output_tokens_per_s"]]
        ax.plot([p["output_tokens_per_s"] for p in pts], [p["per_request_output_tokens_per_s"] for p in pts],
                "o-", label=d["label"])
        for p in pts:
            ax.annotate(f"B{p['batch_size']}", (p["output_tokens_per_s"], p["per_request_output_tokens_per_s"]))
    _finish(ax, "total output tokens/s", "per-request output tokens/s (median)", "Latency/throughput frontier")
    fig.savefig(paths["frontier"], dpi=110, bbox_inches="tight")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for d in datasets:
        b = [p["batch_size"] for p in d["points"]]
        for key, style in (("ttft_p50", "o-"), ("ttft_p95", "s--"), ("ttft_p99", "^:")):
            axes[0].plot(b, [_ms(p[key]) for p in d["points"]], style, label=f"{d['label']} {key[5:]}")
        for key, style in (("tpot_p50", "o-"), ("tpot_p95", "s--")):
            axes[1].plot(b, [_ms(p[key]) for p in d["points"]], style, label=f"{d['label']} {key[5:]}")
    for ax in axes:
        ax.set_xscale("log", base=2)
    _finish(axes[0], "batch size", "TTFT ms", "Time to first token")
    _finish(axes[1], "batch size", "TPOT ms", "Time per output token")
    fig.savefig(paths["latency"], dpi=110, bbox_inches="tight")
    plt.close("all")
    return paths


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000


def _finish(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
