"""Presentation: rich tables for the terminal and JSON documents. (The PNG is in plot.py.)"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from .catalog import CATALOG
from .dtypes import QUANTISED_DTYPES
from .hardware import HardwareSpec
from .measured import Efficiency
from .model_specs import PRESET_CONFIGS, ModelSpec, kv_elements_per_token, param_counts, preset
from .roofline import Plan
from .study import Ratio, StudyCheck


def si(value: float, unit: str, digits: int = 3) -> str:
    """1.411e11, 'B' -> '141 GB': significant digits, decimal prefixes throughout."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def describe_model(m: ModelSpec) -> str:
    c = param_counts(m)
    arch = f"{m.num_layers} layers, d={m.hidden_size}, {m.num_heads} heads"
    if m.mla:
        arch += f", MLA (kv_lora {m.mla.kv_lora_rank} + rope {m.mla.qk_rope_head_dim})"
    else:
        arch += f", {m.num_kv_heads} KV heads x {m.head_dim}"
    if m.moe:
        arch += f", MoE {m.moe.num_experts} experts top-{m.moe.top_k}"
        arch += f" + {m.moe.num_shared_experts} shared" if m.moe.num_shared_experts else ""
    return f"{m.name}: {c.total / 1e9:.2f}B params ({c.active / 1e9:.2f}B active); {arch}"


def memory_size(nbytes: float) -> str:
    """Decimal GB, and the binary GiB that nvidia-smi and torch count in: '85.9 GB (80.0 GiB)'."""
    return f"{si(nbytes, 'B')} ({nbytes / 2**30:.1f} GiB)"


def describe_hardware(hw: HardwareSpec, devices: int = 1) -> str:
    fp8 = f", {si(hw.fp8_flops, 'FLOP/s')} fp8" if hw.fp8_flops else ""
    return (f"{devices} x {hw.name}: {memory_size(hw.memory_bytes)}, "
            f"{si(hw.bandwidth_bytes_per_s, 'B/s')}, "
            f"{si(hw.bf16_flops, 'FLOP/s')} {'measured' if hw.measured else 'bf16'}{fp8} each")


def does_not_fit(plan: Plan) -> str:
    """Why nothing fits, and the smallest tensor-parallel group of this hardware that would."""
    c, mem, hw = plan.config, plan.memory, plan.hardware
    tp = c.tp or 1
    usable = mem.usable_kv_bytes_per_replica + mem.weight_bytes
    why = (f"weights {si(mem.weight_bytes, 'B')} + one request's KV "
           f"{si(mem.kv_bytes_per_request, 'B')} exceed the {si(usable, 'B')} usable on "
           f"{tp} x {hw.name} ({1 - c.reserve_fraction:.0%} of {si(hw.memory_bytes, 'B')} each)")
    if plan.devices_needed is None:
        return (f"{why}; no tensor-parallel group of up to {plan.model.num_heads} x {hw.name} "
                "holds it at this dtype")
    flag = (f"--num-devices {plan.devices_needed}" if c.num_devices == tp
            else f"--tp {plan.devices_needed} and --num-devices a multiple of it")
    return (f"{why}; needs at least {plan.devices_needed} x {hw.name} in one tensor-parallel "
            f"group ({flag})")


def plan_summary(plan: Plan) -> list[str]:
    c, mem, hw = plan.config, plan.memory, plan.hardware
    replicas = c.num_devices // (c.tp or 1)
    price = (f"${c.price_per_hour:.2f}/h each = ${plan.price_per_hour_total:.2f}/h"
             if plan.price_per_hour_total else "no price (pass --price-per-hour)")
    knee = (f"compute-bound from B={plan.compute_bound_from}" if plan.compute_bound_from
            else "never compute-bound at this context")
    kv_from = f"KV reads exceed weight reads from B={plan.kv_dominates_from}" \
        if plan.kv_dominates_from else "weight reads dominate at every batch"
    copies = mem.kv_bytes_per_token_stored / mem.kv_bytes_per_token
    tables = " (embedding and lm_head 16-bit)" if c.weight_dtype in QUANTISED_DTYPES else ""
    return [
        f"[bold]Model[/]     {describe_model(plan.model)}",
        f"[bold]Hardware[/]  {describe_hardware(hw, c.num_devices)}; TP {c.tp}, "
        f"{replicas} replica(s); {price}",
        f"[bold]Workload[/]  {c.input_len} input + {c.output_len} output tokens/request; "
        f"weights {c.weight_dtype}{tables}, KV {c.kv_dtype}; reserve {c.reserve_fraction:.0%} of memory",
        f"[bold]Memory[/]    weights {si(mem.weight_bytes, 'B')} "
        f"({si(mem.weight_bytes_per_device, 'B')}/device); KV {mem.kv_bytes_per_token:,.0f} "
        f"B/token{f' x{copies:.0f} (TP copies)' if copies > 1 else ''}, "
        f"{si(mem.kv_bytes_per_request, 'B')}/request; [bold]largest batch {mem.max_batch}[/]",
        f"[bold]Decode[/]    {knee}; {kv_from}",
        *[f"[yellow]note[/]      {n}" for n in plan.notes],
        *([] if plan.fits else [f"[bold red]Does not fit[/]: {does_not_fit(plan)}"]),
    ]


def plan_table(plan: Plan, eff: list[Efficiency] | None = None) -> Table:
    table = Table(title="Ceilings: no engine beats these on this hardware",
                  caption="times are lower bounds, tok/s upper bounds, $/M floors; gain: decode "
                  "tok/s vs the previous row; e2e: prefill then decode, ovl: prefill hidden "
                  "under decode", box=box.SIMPLE_HEAD, collapse_padding=True)
    for col in ("batch", "fits", "step\nms", "decode\ntok/s", "gain", "prefill\ns",
                "e2e\ntok/s", "ovl\ntok/s", "$/M\nout", "limit"):
        table.add_column(col, justify="left" if col in ("fits", "limit") else "right",
                         no_wrap=True)
    by_batch = {e.batch_size: e for e in eff or []}
    if eff:
        for col in ("measured\nout tok/s", "eff\ne2e", "eff\ndecode", "eff\nprefill"):
            table.add_column(col, justify="right", no_wrap=True)
    previous = None
    for p in plan.points:
        gain = f"x{p.decode_tokens_per_s / previous:.2f}" if previous else ""
        previous = p.decode_tokens_per_s
        cells = [str(p.batch_size), "yes" if p.fits else "[red]no[/]",
                 f"{p.decode_step_s * 1e3:.2f}", f"{p.decode_tokens_per_s:,.0f}", gain,
                 f"{p.prefill_s:.3f}", f"{p.e2e_tokens_per_s:,.0f}",
                 f"{p.e2e_overlap_tokens_per_s:,.0f}",
                 "-" if p.usd_per_m_output is None else f"{p.usd_per_m_output:.3f}", p.limit]
        if eff:
            e = by_batch.get(p.batch_size)
            cells += ["", "", "", ""] if e is None else [
                f"{e.output_tokens_per_s:,.1f}", _pct(e.output), _pct(e.decode),
                _pct(e.prefill)]
        table.add_row(*cells)
    return table


def print_plan(plan: Plan, eff: list[Efficiency] | None = None,
               console: Console | None = None) -> None:
    console = console or Console()
    for line in plan_summary(plan):
        console.print(line, highlight=False)
    if not plan.fits:  # ceilings and $/M of a deployment that cannot run would mislead
        return
    console.print(plan_table(plan, eff))
    above = [e.batch_size for e in eff or [] if e.above_ceiling]
    if above:
        console.print(f"[red]measured above the ceiling at batch {above}: check the hardware, "
                      "dtypes and lengths given to the planner[/]")


def models_table() -> Table:
    table = Table(title="Model presets")
    for col in ("name", "params", "active", "layers", "KV B/token (bf16)", "arch"):
        table.add_column(col)
    for name in PRESET_CONFIGS:
        m = preset(name)
        c = param_counts(m)
        arch = "MLA+MoE" if m.mla and m.moe else "MoE" if m.moe else "dense"
        table.add_row(name, f"{c.total / 1e9:.2f}B", f"{c.active / 1e9:.2f}B",
                      str(m.num_layers), f"{kv_elements_per_token(m) * 2:,}", arch)
    return table


def hardware_table() -> Table:
    table = Table(title="Hardware catalog (per device, dense; memory as the device reports it; "
                  "prices are defaults)")
    for col in ("name", "memory", "bandwidth", "bf16", "fp8", "int8", "$/h", "source"):
        table.add_column(col)
    for key, hw in CATALOG.items():
        table.add_row(key, memory_size(hw.memory_bytes), si(hw.bandwidth_bytes_per_s, "B/s"),
                      si(hw.bf16_flops, "FLOP/s"),
                      si(hw.fp8_flops, "FLOP/s") if hw.fp8_flops else "-",
                      si(hw.int8_ops, "OP/s") if hw.int8_ops else "-",
                      f"{hw.price_per_hour:.2f}", hw.notes)
    table.add_row("this-machine", "RAM", "measured", "measured fp32", "-", "-", "0.00",
                  "torch GEMM + copy, on the spot")
    return table


def study_table(check: StudyCheck) -> Table:
    table = Table(title=f"Published study vs ceilings ({check.study.input_len} in / "
                  f"{check.study.output_len} out); fraction of decode ceiling "
                  "(of back-to-back e2e ceiling)")
    for col in ("model", "implied deployment", "B1 decode", "B32 total", "B64 total",
                "implied $/h", "verdict"):
        table.add_column(col)
    for r in check.rows:
        cells = []
        for ratio in (r.b1, r.b32, r.b64):
            cells.append("-" if ratio is None else (
                f"{ratio.measured.value:,.0f} / {ratio.decode_ceiling:,.0f} = "
                f"{ratio.of_decode:.2f} ({ratio.of_e2e:.2f})"))
        verdict = ("[red]IMPOSSIBLE: " + ", ".join(r.impossible) + "[/]" if r.impossible
                   else "under ceiling" if r.deployment else "no catalog deployment fits")
        if r.inconsistencies:
            verdict += "; " + "; ".join(r.inconsistencies)
        table.add_row(r.row.label, r.deployment.describe() if r.deployment else "-", *cells,
                      f"{r.implied_usd_per_hour.value:.2f}", verdict)
    return table


def print_study(check: StudyCheck, console: Console | None = None) -> None:
    console = console or Console()
    console.print(study_table(check))
    for c in check.claims:
        console.print(f"[bold]{c.claim}[/]: [cyan]{c.verdict}[/] - {c.detail}", highlight=False)


def _ratio_cell(ratio: Ratio | None) -> str:
    if ratio is None:
        return "-"
    return (f"{ratio.measured.value:,.0f} / {ratio.decode_ceiling:,.0f} = "
            f"**{ratio.of_decode:.2f}** ({ratio.of_e2e:.2f})")


def study_markdown(check: StudyCheck) -> str:
    """The study check as Markdown, for docs/plan.md."""
    lines = [
        "| model | implied deployment | B1 decode | B32 total | B64 total | implied $/h "
        "| cheapest possible | verdict |",
        "|---|---|---|---|---|---|---|---|"]
    for r in check.rows:
        d, c = r.deployment, r.cheapest
        cheapest = f"{c.describe()} ${c.usd_per_hour:.2f}/h" if c else "none in catalog"
        verdict = ("IMPOSSIBLE: " + ", ".join(r.impossible) if r.impossible
                   else "under ceiling" if d else "no catalog deployment fits")
        verdict += "".join(f"; {p}" for p in r.inconsistencies)
        lines.append(f"| {r.row.label} | {d.describe() if d else '-'} | {_ratio_cell(r.b1)} | "
                     f"{_ratio_cell(r.b32)} | {_ratio_cell(r.b64)} | "
                     f"{r.implied_usd_per_hour.value:.2f} | "
                     f"{cheapest} | {verdict} |")
    lines.append("")
    lines += [f"- **{c.claim}**: *{c.verdict}*. {c.detail}." for c in check.claims]
    return "\n".join(lines) + "\n"


# --- JSON ---------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """Dataclasses to dicts; inf/nan (e.g. prefill rate with no prompt) to null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def plan_json(plan: Plan, eff: list[Efficiency] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = _jsonable(plan)
    doc["efficiency"] = [dict(_jsonable(e), above_ceiling=e.above_ceiling) for e in eff or []]
    return doc


def study_json(check: StudyCheck) -> dict[str, Any]:
    rows = []
    for r in check.rows:
        row: dict[str, Any] = {"model": r.row.label, "preset": r.model.name,
               "deployment": r.deployment.describe() if r.deployment else None,
               "implied_usd_per_hour": r.implied_usd_per_hour.value,
               "impossible": r.impossible, "inconsistencies": list(r.inconsistencies),
               "cheapest_possible": r.cheapest.describe() if r.cheapest else None,
               "cheapest_possible_usd_per_hour": r.cheapest.usd_per_hour if r.cheapest
               else None}
        for name, ratio in (("b1_decode", r.b1), ("b32_total", r.b32), ("b64_total", r.b64)):
            row[name] = None if ratio is None else {
                "measured": ratio.measured.value, "decode_ceiling": ratio.decode_ceiling,
                "e2e_ceiling": ratio.e2e_ceiling, "of_decode": ratio.of_decode,
                "of_e2e": ratio.of_e2e}
        rows.append(row)
    return {"input_len": check.study.input_len, "output_len": check.study.output_len,
            "hardware_tried": list(check.hardware), "rows": rows,
            "claims": [_jsonable(c) for c in check.claims]}


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
