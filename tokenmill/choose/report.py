"""What `tokenmill choose` shows: the terminal table, report.md, report.json and report.png.

Every figure is one the runner measured or projected (results.py); the only bounds are the
planner's ceilings, always labelled as such, and the quality intervals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tokenmill.choose.results import DONE, CandidateResult, ChooseReport
from tokenmill.choose.stats import basis_phrase, format_bar, format_quality, format_usd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLUMNS_EXPLAINED = (
    "quality = the mean score over the sample rows with its 95% interval (Wilson for pass/fail scores, "
    "bootstrap for graded ones); failed rows count as 0. "
    "$/M out = what the sample cost ÷ its output tokens, in millions. "
    "projected = the whole job: token counts from the full file, at the rates measured on the sample. "
    "ceiling = the planner's bound for that hardware, not a measurement."
)


def candidate_rows(report: ChooseReport) -> list[dict[str, str]]:
    """One row per candidate, header → cell: the terminal and the Markdown tables both show these."""
    return [_row(c, report.hardware) for c in report.candidates]


def _row(c: CandidateResult, hardware: str | None) -> dict[str, str]:
    p = c.projected
    row = {
        "candidate": c.name,
        "model": short_model(c.model),
        "price": "its tiers'" if c.cascade else c.price.describe(),
        "quality": format_quality(c.quality) if c.quality is not None else "–",
        "rows": f"{c.answered}/{c.rows}" + (f" ({c.failed} failed)" if c.failed else ""),
        "out tok/s": _number(c.output_tok_s, 1),
        "prefill tok/s": _number(c.prefill_tok_s, 0),
        "$/M out": format_usd(c.usd_per_m_output),
        "projected time": format_duration(p.wall_s if p else None),
        "projected $": format_usd(p.usd if p else None),
    }
    if hardware:
        row[f"ceiling $/M on {hardware}"] = format_usd(c.ceiling.usd_per_m_output if c.ceiling else None)
    row["status"] = status_text(c)
    return row


def short_model(model: str) -> str:
    """The last part of a path or a hub id: the rest rarely tells two candidates apart."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    return name or "–"


def status_text(c: CandidateResult) -> str:
    return c.status if c.status == DONE or not c.reason else f"{c.status}: {c.reason}"


def format_duration(seconds: float | None) -> str:
    """45 s, 12.5 min, 3.2 h."""
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.1f} h"


def _number(value: float | None, digits: int) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def notes_text(c: CandidateResult) -> str:
    """Why rows scored below 1, most frequent first: "12 wrong label, 3 no label"."""
    counted = sorted(c.notes.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{n} {why}" for why, n in counted)


def title(report: ChooseReport) -> str:
    v = report.verdict
    return (f"tokenmill choose · {report.sample:,} of {report.job_rows:,} rows · scorer {report.scorer} · "
            f"bar {format_bar(v.bar)} by {basis_phrase(v.clear_by)}")


_WORDY_COLUMNS = {"model", "price", "status"}


def print_report(report: ChooseReport, console: Console) -> None:
    """The table, then the warnings, the notes and the verdict."""
    rows = candidate_rows(report)
    table = Table(title=title(report), title_justify="left")
    for header in rows[0] if rows else ("candidate",):
        # Only the wordy columns wrap: a number or an interval split over two lines misreads.
        wordy = header in _WORDY_COLUMNS
        table.add_column(header, justify="left" if wordy or header == "candidate" else "right", no_wrap=not wordy,
                         overflow="fold")
    for row in rows:
        # Text cells: names, reasons and models are the user's, and must not be read as markup.
        table.add_row(*(Text(cell) for cell in row.values()))
    console.print(table)
    for warning in report.warnings:
        console.print(Text("warning: ", style="yellow") + Text(warning))
    for c in report.candidates:
        if c.notes:
            console.print(Text(f"{c.name}: {notes_text(c)}"))
        if c.cascade:
            console.print(Text(f"{c.name}: {cascade_text(c)}"))
    if dominated := dominated_text(report):
        console.print(Text(dominated))
    console.print(Text(report.verdict.message, style="bold"))


def markdown(report: ChooseReport) -> str:
    v = report.verdict
    rows = candidate_rows(report)
    dominated = dominated_text(report)
    lines = [
        f"# tokenmill choose: {report.job}",
        "",
        f"A random sample of {report.sample:,} of the job's {report.job_rows:,} rows (seed {report.seed}), "
        f"scored by `{report.scorer}`; the bar: {format_bar(v.bar)} by its {basis_phrase(v.clear_by)}.",
        "",
        _md_table(rows) if rows else "No candidates.",
        "",
        f"**Verdict:** {v.message}",
        "",
        *([f"**Pareto:** {dominated}", ""] if dominated else []),
        COLUMNS_EXPLAINED,
        "",
    ]
    notes = [f"- {c.name}: {notes_text(c)}" for c in report.candidates if c.notes]
    if notes:
        lines += ["## Why rows scored below 1", "", *notes, ""]
    cascades = [f"- {c.name}: {cascade_text(c)}" for c in report.candidates if c.cascade]
    if cascades:
        lines += ["## Cascades", "", *cascades, ""]
    flags = [f"- {c.name}: `{c.flags}`" for c in report.candidates if c.flags]
    if flags:
        lines += ["## How each candidate ran (`tokenmill run` flags)", "", *flags, ""]
    if report.warnings:
        lines += ["## Warnings", "", *[f"- {w}" for w in report.warnings], ""]
    return "\n".join(lines)


def _md_table(rows: list[dict[str, str]]) -> str:
    head = list(rows[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_md_cell(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe in a reason would end the cell


def cascade_text(c: CandidateResult) -> str:
    """Where a cascade's sample rows went: "10 rows to small, 6 on to api; accept min-logprob>=-0.5 (calibrated)"."""
    assert c.cascade is not None
    d = c.cascade
    went = ", ".join(f"{n} {'to' if i == 0 else 'on to'} {tier}" for i, (tier, n) in enumerate(zip(d.tiers, d.reached,
                                                                                                   strict=True)))
    return f"{went}; accept {d.accept}" + (" (calibrated on this sample)" if d.calibrated is not None else "")


def dominated_text(report: ChooseReport) -> str:
    """The plotted points another beats (cheaper or as cheap, and as good or better), and by which."""
    points = [(c.name, _cost(c), c.quality.mean) for c in report.candidates if _plottable(c) and c.quality]
    front = set(pareto_front(points))
    beaten = []
    for name, cost, q in points:
        if name not in front:
            by = min((p for p in points if p[0] in front and p[1] <= cost and p[2] >= q), key=lambda p: (p[1], -p[2]))
            beaten.append(f"{name} (by {by[0]})")
    return f"dominated (another is as cheap and as good): {', '.join(beaten)}" if beaten else ""


def pareto_front(points: Sequence[tuple[str, float, float]]) -> list[str]:
    """The names of the (name, cost, quality) points that no other point beats: cheaper-or-equal and
    better-or-equal, one of them strictly. In order of cost (then the better first, then by name)."""
    front = [(name, cost, q) for name, cost, q in points
             if not any(c2 <= cost and q2 >= q and (c2 < cost or q2 > q) for _, c2, q2 in points)]
    return [name for name, _, _ in sorted(front, key=lambda p: (p[1], -p[2], p[0]))]


def report_files(out: Path) -> dict[str, Path]:
    """report.md, report.json and report.png in `out`, by kind."""
    return {"markdown": out / "report.md", "json": out / "report.json", "png": out / "report.png"}


def write_reports(report: ChooseReport, out: Path) -> dict[str, Path]:
    """The `report_files`, written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = report_files(out)
    paths["markdown"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report.to_json(), indent=2) + "\n")
    plot(report, paths["png"])
    return paths


def plot(report: ChooseReport, path: Path) -> Path:
    """The `figure`, written as a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(report).savefig(path, dpi=110, bbox_inches="tight")
    return path


def figure(report: ChooseReport) -> Figure:
    """Quality (with its 95% interval) against the projected cost of the whole job, one point per
    finished candidate with a known cost; the bar, the Pareto front and the choice marked."""
    from matplotlib.figure import Figure

    # A bare Figure, not pyplot's: nothing global to switch (no display on servers) or to close.
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    shown = [c for c in report.candidates if _plottable(c)]
    if shown:
        _draw_points(ax, shown, report.verdict.chosen)
    else:
        ax.text(0.5, 0.5, "no finished candidate with a known cost", ha="center", transform=ax.transAxes)
    bar = report.verdict.bar
    ax.axhline(bar, linestyle="--", color="grey", linewidth=1)
    ax.text(1.0, bar, f" bar {format_bar(bar)}", transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    ax.set_xlabel("projected cost of the whole job ($)")
    ax.set_ylabel("quality: mean score, 95% interval")
    ax.set_title(f"quality vs cost of the whole job ({report.job_rows:,} rows)")
    ax.grid(alpha=0.3)
    footnote = _left_out(report)
    if footnote:
        fig.text(0.01, -0.02, footnote, fontsize=7, va="top", wrap=True)
    return fig


def _plottable(c: CandidateResult) -> bool:
    return c.status == DONE and c.quality is not None and c.projected is not None and c.projected.usd is not None


def _cost(c: CandidateResult) -> float:
    assert c.projected is not None and c.projected.usd is not None  # _plottable
    return c.projected.usd


def _draw_points(ax: Any, shown: list[CandidateResult], chosen: str | None) -> None:
    from matplotlib.ticker import FuncFormatter

    costs = [_cost(c) for c in shown]
    qualities = [c.quality for c in shown if c.quality is not None]  # all of them: _plottable
    means = [q.mean for q in qualities]
    errors = [[q.mean - q.low for q in qualities], [q.high - q.mean for q in qualities]]
    for kind, marker, color in (("candidate", "o", "tab:blue"), ("cascade", "s", "tab:purple")):
        chosen_kind = [i for i, c in enumerate(shown) if (c.cascade is not None) == (kind == "cascade")]
        if chosen_kind:
            ax.errorbar([costs[i] for i in chosen_kind], [means[i] for i in chosen_kind],
                        yerr=[[errors[0][i] for i in chosen_kind], [errors[1][i] for i in chosen_kind]],
                        fmt=marker, color=color, capsize=3, label=kind)
    for c, x, y in zip(shown, costs, means, strict=True):
        ax.annotate(c.name, (x, y), xytext=(5, 5), textcoords="offset points", fontsize=8)
    front = pareto_front([(c.name, x, y) for c, x, y in zip(shown, costs, means, strict=True)])
    at = {c.name: (x, y) for c, x, y in zip(shown, costs, means, strict=True)}
    ax.step([at[n][0] for n in front], [at[n][1] for n in front], where="post", color="tab:green", alpha=0.6)
    ax.plot([at[n][0] for n in front], [at[n][1] for n in front], "D", markersize=9, markerfacecolor="none",
            markeredgecolor="tab:green", label="Pareto front")
    if chosen is not None and chosen in at:
        ax.plot(*at[chosen], "*", markersize=18, color="tab:red", zorder=5, label=f"chosen: {chosen}")
    if log_scale(costs):
        ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"${x:g}"))
    ax.legend(fontsize=7, loc="best", markerscale=0.6)


def log_scale(costs: Sequence[float]) -> bool:
    """A log cost axis where the costs span more than 10×; never with a free ($0) candidate, which it
    could not show."""
    return bool(costs) and min(costs) > 0 and max(costs) > 10 * min(costs)


def _left_out(report: ChooseReport) -> str:
    unknown = [c.name for c in report.candidates
               if c.status == DONE and c.quality is not None and not _plottable(c)]
    unfinished = [c.name for c in report.candidates if c.status != DONE or c.quality is None]
    parts = []
    if unknown:
        parts.append(f"cost unknown: {', '.join(unknown)}")
    if unfinished:
        parts.append(f"did not finish: {', '.join(unfinished)}")
    return f"not plotted ({'; '.join(parts)})" if parts else ""
