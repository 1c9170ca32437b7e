"""Check the published batch study (batch-study.md, shipped beside this module) against the ceilings.

The reference file is parsed at run time (it is the outside world's claim, not ours), every
figure keeps the rounding its printed digits imply, and each measured number is compared with
the planner's ceiling on the deployment the study implies (it names no hardware).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from tokenmill.cost import usd_per_hour, usd_per_million

from .catalog import CATALOG
from .errors import PlanError
from .model_specs import ModelSpec, kv_elements_per_token, param_counts, preset
from .roofline import (
    Plan,
    PlanConfig,
    PlanPoint,
    make_plan,
    make_setup,
    matmul_flops,
    memory_plan,
    min_batch_for,
)

# Package data (pyproject.toml), so an installed tokenmill has it as a checkout does.
DEFAULT_STUDY: Traversable = files("tokenmill.plan") / "batch-study.md"
IMPLIED_HARDWARE = ("h100-sxm", "h200", "b200")  # tried in this order
IMPLIED_COUNTS = (1, 2, 4, 8)  # one node at most

# --- parsing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A printed number and the half-width of the rounding its digits imply."""

    value: float
    half_unit: float

    @property
    def lo(self) -> float:
        return self.value - self.half_unit

    @property
    def hi(self) -> float:
        return self.value + self.half_unit


def parse_figure(text: str) -> Figure:
    """'2,810' -> 2810 +- 5 (trailing zeros read as rounding), '0.18' -> +- 0.005,
    '+17%' -> 0.17 +- 0.005."""
    raw = text.strip().replace(",", "").replace("$", "").lstrip("+~")
    scale = 0.01 if raw.endswith("%") else 1.0
    raw = raw.rstrip("%")
    if not re.fullmatch(r"-?\d+(\.\d+)?", raw):
        raise PlanError("study", f"not a number: {text!r}")
    if "." in raw:
        half = 0.5 * 10 ** -len(raw.split(".")[1])
    else:
        digits = raw.lstrip("-")
        half = 0.5 * 10 ** (len(digits) - len(digits.rstrip("0"))) if digits != "0" else 0.5
    return Figure(float(raw) * scale, half * scale)


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every pipe table in ``text`` as a list of {lower-cased header: cell} rows."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            header = [h.lower() for h in block[0]]
            tables.append([dict(zip(header, row, strict=False)) for row in block[2:]])
        block = []
    return tables


@dataclass(frozen=True)
class StudyRow:
    label: str  # the model as the study names it
    b1_decode: Figure
    b32_total: Figure
    b32_per_request: Figure
    b64_total: Figure
    b64_gain: Figure  # fraction: 0.17 for +17%
    usd_per_m: Figure
    m_tokens_per_usd: Figure


@dataclass(frozen=True)
class Study:
    input_len: int
    output_len: int
    batch_sizes: tuple[int, ...]
    rows: tuple[StudyRow, ...]
    kinds: dict[str, str]  # model label -> description
    text: str


_COLUMNS = {  # StudyRow field -> results-table header
    "b1_decode": "b1 decode tok/s", "b32_total": "b32 total tok/s",
    "b32_per_request": "b32 per-request tok/s", "b64_total": "b64 total tok/s",
    "b64_gain": "b64 gain vs b32", "usd_per_m": "$/m output (b32)",
    "m_tokens_per_usd": "m tokens/$",
}


def _study_row(row: dict[str, str]) -> StudyRow:
    for header in _COLUMNS.values():
        if header not in row:
            raise PlanError("study", f"results table has no column {header!r}")
    return StudyRow(row["model"], **{f: parse_figure(row[h]) for f, h in _COLUMNS.items()})


def _search_int(pattern: str, text: str, what: str) -> re.Match[str]:
    match = re.search(pattern, text)
    if match is None:
        raise PlanError("study", f"cannot find the {what} in the study text")
    return match


def parse_study(text: str) -> Study:
    """Protocol (lengths, batch sizes), the results table and the models table."""
    lengths = _search_int(r"([\d,]+) input tokens and ([\d,]+) output tokens", text, "lengths")
    batches = _search_int(r"Batch sizes[^:]*:\s*([\d,\s]+\d)", text, "batch sizes")
    tables = markdown_tables(text)
    results = next((t for t in tables if t and _COLUMNS["b32_total"] in t[0]), None)
    if results is None:
        raise PlanError("study", "no results table with a 'B32 total tok/s' column")
    kinds = next((t for t in tables if t and "kind" in t[0]), [])
    return Study(
        input_len=int(lengths.group(1).replace(",", "")),
        output_len=int(lengths.group(2).replace(",", "")),
        batch_sizes=tuple(int(b) for b in re.split(r"[,\s]+", batches.group(1).strip())),
        rows=tuple(_study_row(r) for r in results),
        kinds={r["model"]: r["kind"] for r in kinds}, text=text)


def load_study(path: str | Path | None = None) -> Study:
    """Parse the study at ``path`` (default: the copy shipped with the package)."""
    where: Traversable = Path(path) if path else DEFAULT_STUDY
    hint = "" if path else " (give the study's Markdown file with --study-file PATH)"
    try:
        text = where.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError("study", f"cannot read {where}: {exc.strerror}{hint}") from None
    except UnicodeDecodeError:
        raise PlanError("study", f"{where} is not UTF-8 text (the study is a Markdown file)") \
            from None
    return parse_study(text)


# --- the check ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    hardware: str  # catalog key
    num_devices: int  # all in one tensor-parallel group
    weight_dtype: str

    @property
    def usd_per_hour(self) -> float:
        """At the catalog's default prices."""
        return CATALOG[self.hardware].price_per_hour * self.num_devices

    def describe(self) -> str:
        return f"{self.num_devices}x{CATALOG[self.hardware].name} TP{self.num_devices} " \
               f"{self.weight_dtype}"


def study_config(study: Study, d: Deployment, batch_sizes: tuple[int, ...] = ()) -> PlanConfig:
    return PlanConfig(num_devices=d.num_devices, tp=d.num_devices, weight_dtype=d.weight_dtype,
                      input_len=study.input_len, output_len=study.output_len,
                      batch_sizes=batch_sizes or study.batch_sizes)


def implied_deployment(model: ModelSpec, study: Study,
                       hardware: tuple[str, ...] = IMPLIED_HARDWARE) -> Deployment | None:
    """The smallest common single-node deployment that runs the study's largest batch.

    The model runs in the dtype its checkpoint ships in (bf16; fp8 for DeepSeek-V3), on the
    first GPU type in ``hardware`` where 1, 2, 4 or 8 devices in one TP group hold the weights
    plus the KV cache of max(batch_sizes) requests at input+output tokens. Fewer devices is
    the cheapest way to run it and also the lowest ceiling that is still plausible."""
    need = max(study.batch_sizes)
    for hw in hardware:
        for n in IMPLIED_COUNTS:
            d = Deployment(hw, n, model.default_weight_dtype)
            try:
                setup = make_setup(model, CATALOG[hw], study_config(study, d))
            except PlanError:  # e.g. tp does not divide the heads
                continue
            if memory_plan(setup).max_batch >= need:
                return d
    return None


@dataclass(frozen=True)
class Ratio:
    """A measured figure against the decode ceiling and the back-to-back e2e ceiling."""

    measured: Figure
    decode_ceiling: float
    e2e_ceiling: float

    @property
    def of_decode(self) -> float:
        return self.measured.value / self.decode_ceiling

    @property
    def of_e2e(self) -> float:
        return self.measured.value / self.e2e_ceiling

    @property
    def impossible(self) -> bool:
        """Above the decode-only ceiling even at the bottom of its rounding: no reading of the
        figure (with or without prefill time) makes it reachable."""
        return self.measured.lo > self.decode_ceiling


@dataclass(frozen=True)
class RowCheck:
    row: StudyRow
    model: ModelSpec
    deployment: Deployment | None
    plan: Plan | None
    b1: Ratio | None
    b32: Ratio | None
    b64: Ratio | None
    implied_usd_per_hour: Figure  # what the row's $/M and B32 tok/s imply
    inconsistencies: tuple[str, ...]  # arithmetic within the row that does not add up
    cheapest: Deployment | None = None  # cheapest catalog deployment the figures fit under

    @property
    def impossible(self) -> list[str]:
        named = (("B1 decode", self.b1), ("B32 total", self.b32), ("B64 total", self.b64))
        return [name for name, r in named if r is not None and r.impossible]


def implied_usd_per_hour(row: StudyRow) -> Figure:
    """$/hour = $/M output x M output tokens per hour at the B32 rate."""
    lo = usd_per_hour(row.usd_per_m.lo, row.b32_total.lo)
    hi = usd_per_hour(row.usd_per_m.hi, row.b32_total.hi)
    return Figure(usd_per_hour(row.usd_per_m.value, row.b32_total.value), (hi - lo) / 2)


def _overlaps(lo: float, hi: float, fig: Figure) -> bool:
    return lo <= fig.hi and fig.lo <= hi


def row_inconsistencies(row: StudyRow, batch: int = 32) -> list[str]:
    """Arithmetic the row's own figures must satisfy, allowing for their printed rounding."""
    problems = []
    pr = row.b32_per_request
    if not _overlaps(pr.lo * batch, pr.hi * batch, row.b32_total):
        problems.append(f"per-request {pr.value:g} x {batch} != total {row.b32_total.value:g}")
    gain_lo = row.b64_total.lo / row.b32_total.hi - 1
    gain_hi = row.b64_total.hi / row.b32_total.lo - 1
    if not _overlaps(gain_lo, gain_hi, row.b64_gain):
        problems.append(f"B64/B32 = {row.b64_total.value / row.b32_total.value - 1:+.1%}, "
                        f"stated {row.b64_gain.value:+.0%}")
    inv_lo, inv_hi = 1 / row.usd_per_m.hi, 1 / row.usd_per_m.lo
    if not _overlaps(inv_lo, inv_hi, row.m_tokens_per_usd):
        problems.append(f"1/($/M) = {1 / row.usd_per_m.value:.2f}, stated "
                        f"{row.m_tokens_per_usd.value:g} M tokens/$")
    return problems


def _ratio(point: PlanPoint, fig: Figure) -> Ratio:
    return Ratio(fig, point.decode_tokens_per_s, point.e2e_tokens_per_s)


def check_row(row: StudyRow, study: Study,
              hardware: tuple[str, ...] = IMPLIED_HARDWARE) -> RowCheck:
    model = preset(row.label)
    d = implied_deployment(model, study, hardware)
    plan, b1, b32, b64 = None, None, None, None
    if d is not None:
        plan = make_plan(model, CATALOG[d.hardware], study_config(study, d, (1, 32, 64)))
        pts = {p.batch_size: p for p in plan.points}
        b1, b32 = _ratio(pts[1], row.b1_decode), _ratio(pts[32], row.b32_total)
        b64 = _ratio(pts[64], row.b64_total)
    return RowCheck(row, model, d, plan, b1, b32, b64, implied_usd_per_hour(row),
                    tuple(row_inconsistencies(row)), cheapest_possible(row, model, study))


def cheapest_possible(row: StudyRow, model: ModelSpec, study: Study) -> Deployment | None:
    """The cheapest catalog deployment (any GPU type, 1-8 devices, the checkpoint's dtype, at
    default prices) that holds the largest batch and whose decode ceilings all three figures
    sit under: a floor on what the hardware behind the row can have cost."""
    best: Deployment | None = None
    for hw in CATALOG:
        for n in IMPLIED_COUNTS:
            d = Deployment(hw, n, model.default_weight_dtype)
            if best is not None and d.usd_per_hour >= best.usd_per_hour:
                continue
            try:
                plan = make_plan(model, CATALOG[hw], study_config(study, d, (1, 32, 64)))
            except PlanError:
                continue
            pts = {p.batch_size: p for p in plan.points}
            figures = ((1, row.b1_decode), (32, row.b32_total), (64, row.b64_total))
            if plan.memory.max_batch >= max(study.batch_sizes) and not any(
                    _ratio(pts[b], f).impossible for b, f in figures):
                best = d
    return best


# --- the claims made alongside ------------------------------------------------------------


@dataclass(frozen=True)
class ClaimCheck:
    claim: str
    verdict: str  # "holds", "false", "not supported", "inconsistent"
    detail: str


@dataclass(frozen=True)
class StudyCheck:
    study: Study
    hardware: tuple[str, ...]
    rows: tuple[RowCheck, ...]
    claims: tuple[ClaimCheck, ...]


def _find(rows: tuple[RowCheck, ...], preset_name: str) -> RowCheck | None:
    return next((r for r in rows if r.model.name == preset_name), None)


def _kv_per_request(model: ModelSpec, study: Study) -> float:
    return kv_elements_per_token(model) * 2 * (study.input_len + study.output_len)  # bf16


def claim_smaller_kv(study: Study, rows: tuple[RowCheck, ...]) -> ClaimCheck | None:
    """'Qwen2.5 72B is ~19% faster than Llama 3.1 70B at B32 because of a smaller KV cache'."""
    match = re.search(r"Qwen2\.5 72B is ~(\d+)% faster than Llama 3\.1 70B", study.text)
    qwen, llama = _find(rows, "qwen2.5-72b-instruct"), _find(rows, "llama-3.1-70b-instruct")
    if match is None or qwen is None or llama is None:
        return None
    kv_q, kv_l = _kv_per_request(qwen.model, study), _kv_per_request(llama.model, study)
    verdict = "holds" if kv_q < kv_l else "false"
    measured = qwen.row.b32_total.value / llama.row.b32_total.value - 1
    detail = (f"KV per request at {study.input_len + study.output_len} tokens in bf16: Qwen2.5-72B "
              f"{kv_q / 2**20:,.0f} MiB vs Llama-3.1-70B {kv_l / 2**20:,.0f} MiB (both 80 layers x "
              f"8 KV heads x 128 x 2 x 2 B per token); the study's B32 figures differ by "
              f"{measured:+.0%} (claimed ~{match.group(1)}%)")
    if qwen.b32 and llama.b32:
        ceiling = qwen.b32.decode_ceiling / llama.b32.decode_ceiling - 1
        detail += (f"; the planner's B32 ceilings differ by {ceiling:+.1%} (Qwen has "
                   f"{qwen.plan.params_total / 1e9 if qwen.plan else 0:.1f}B params to read vs "
                   f"{llama.plan.params_total / 1e9 if llama.plan else 0:.1f}B)")
    return ClaimCheck("Qwen2.5 72B faster at B32 because of a smaller KV cache per request",
                      verdict, detail)


def claim_kv_fills_memory(study: Study, rows: tuple[RowCheck, ...]) -> ClaimCheck | None:
    """'Large dense models gain little from B32 to B64 because KV cache fills memory.'"""
    if "KV cache fills memory" not in study.text:
        return None
    big = [r for r in rows if r.model.moe is None and r.plan and r.plan.params_total > 50e9]
    if not big:
        return None
    parts, full = [], False
    for r in big:
        assert r.plan is not None and r.b32 is not None and r.b64 is not None
        full |= r.plan.memory.max_batch < 64
        gain = r.b64.decode_ceiling / r.b32.decode_ceiling - 1
        parts.append(f"{r.row.label}: up to {r.plan.memory.max_batch} requests fit on "
                     f"{r.deployment.describe() if r.deployment else '?'}, ceiling gain "
                     f"B32->B64 {gain:+.0%}, measured {r.row.b64_gain.value:+.0%}")
    verdict = "holds" if full else "not supported"
    return ClaimCheck("Large dense models gain little B32->B64 because KV cache fills memory",
                      verdict, "; ".join(parts))


def claim_cost_example(study: Study) -> ClaimCheck | None:
    """'Llama 3 70B on 8xH100 at 6,000 tok/s aggregate and $25/hour -> about $1.16 per M'."""
    m = re.search(r"on (\d+)\s*[x×]\s*(\w+) at ([\d,]+) tok/s aggregate and \$([\d.]+)/hour"
                  r"\s*(?:→|->)\s*about \$([\d.]+) per million", study.text)
    if m is None:
        return None
    n, gpu, tps = int(m.group(1)), m.group(2).lower(), parse_figure(m.group(3)).value
    price, stated = float(m.group(4)), parse_figure(m.group(5))
    usd = usd_per_million(price, tps)
    if usd is None:  # "at 0 tok/s": no cost to check
        return None
    verdict = "holds" if stated.lo <= usd <= stated.hi else "inconsistent"
    detail = f"${price:g}/h / ({tps:,.0f} x 3600 / 1e6 M tokens/h) = ${usd:.3f}/M"
    hw = next((k for k in CATALOG if k.startswith(gpu)), None)
    if hw is not None:  # Llama 3 70B = Llama 3.1 70B's architecture
        model = preset("llama-3.1-70b")
        d = Deployment(hw, n, "bf16")
        setup = make_setup(model, CATALOG[hw], study_config(study, d))
        need = min_batch_for(setup, tps, "e2e")
        detail += (f"; at the study's lengths {n}x{CATALOG[hw].name} bf16 needs >= {need} "
                   f"concurrent requests for {tps:,.0f} tok/s end to end (up to "
                   f"{memory_plan(setup).max_batch} fit), i.e. ${price / n:.2f}/GPU-hour")
    return ClaimCheck("Cost example: 6,000 tok/s at $25/hour is about $1.16/M output tokens",
                      verdict, detail)


def claim_prefix_caching(study: Study, rows: tuple[RowCheck, ...]) -> ClaimCheck | None:
    m = re.search(r"a ([\d,]+)-token\s+prompt over ([\d,]+) requests is ([\d,]+) M tokens",
                  study.text)
    if m is None:
        return None
    prompt, requests, stated = (int(g.replace(",", "")) for g in m.groups())
    tokens = prompt * requests
    verdict = "holds" if tokens == stated * 10**6 else "inconsistent"
    detail = f"{prompt:,} x {requests:,} = {tokens / 1e6:,.0f} M tokens"
    llama = _find(rows, "llama-3.1-70b-instruct")
    if llama and llama.plan and llama.deployment:
        # the compute floor for prefilling the shared prompt once per request
        flops = matmul_flops(param_counts(llama.model), tokens, requests)
        hw = CATALOG[llama.deployment.hardware]
        hours = flops / hw.bf16_flops / 3600
        detail += (f"; for Llama-3.1-70B that is >= {flops:.2e} FLOPs, >= {hours:.1f} "
                   f"{hw.name}-hours at peak bf16")
    return ClaimCheck("Prefix caching: 1,000-token prompt x 100,000 requests = 100 M tokens",
                      verdict, detail)


def claim_quantise(study: Study) -> ClaimCheck | None:
    if "FP8 on H100" not in study.text or "INT4/AWQ on A100" not in study.text:
        return None
    model = preset("llama-3.1-70b")
    parts = []
    for hw, dtypes in (("h100-sxm", ("bf16", "fp8")), ("a100-80gb", ("bf16", "int4"))):
        fits = [memory_plan(make_setup(model, CATALOG[hw],
                                       study_config(study, Deployment(hw, 2, dt)))).max_batch
                for dt in dtypes]
        parts.append(f"2x{CATALOG[hw].name}: {dtypes[0]} {fits[0]} -> {dtypes[1]} {fits[1]}")
    return ClaimCheck("Quantise (FP8 on H100, INT4 on A100) to free memory for larger batches",
                      "holds", "Llama-3.1-70B largest batch at the study's lengths, "
                      + "; ".join(parts))


def claim_descriptions(study: Study) -> ClaimCheck | None:
    """The models table's sizes against the planner's parameter counts (10%: names round)."""
    if not study.kinds:
        return None
    parts, bad = [], []
    for label, kind in study.kinds.items():
        counts = param_counts(preset(label))
        found = {"total": re.search(r"([\d.]+)B (?:total|dense)", kind),
                 "active": re.search(r"~?([\d.]+)B active", kind)}
        for what, m in found.items():
            if m is None:
                continue
            stated = float(m.group(1)) * 1e9
            ours = counts.total if what == "total" else counts.active
            parts.append(f"{label} {what} {stated / 1e9:g}B vs {ours / 1e9:.1f}B")
            if abs(ours / stated - 1) > 0.10:
                bad.append(parts[-1])
    return ClaimCheck("Model sizes in the models table", "inconsistent" if bad else "holds",
                      "; ".join(bad or parts))


def claim_price(rows: tuple[RowCheck, ...]) -> ClaimCheck:
    """What the cost table implies about the $/hour it assumed."""
    implied = [r.implied_usd_per_hour.value for r in rows]
    lo, hi = min(implied), max(implied)
    mean = sum(implied) / len(implied)
    costs = [f"{r.row.label} ${r.implied_usd_per_hour.value:.2f} vs "
             f"${r.cheapest.usd_per_hour:.2f} ({r.cheapest.describe()})"
             for r in rows if r.cheapest]
    flat = hi / lo < 1.5  # within +-20% of each other: one price, not per-deployment costs
    verdict = "flat rate" if flat else "varies"
    below = [r for r in rows if r.cheapest and
             r.implied_usd_per_hour.hi < r.cheapest.usd_per_hour]
    detail = (f"$/M x B32 tok/s x 3600/1e6 gives ${lo:.2f}-{hi:.2f}/hour (mean ${mean:.2f}) "
              f"across models; {len(below)} of {len(rows)} rows imply less than the cheapest "
              "catalog deployment (default prices) that holds B64 and whose ceilings their "
              "figures fit under: " + "; ".join(costs))
    return ClaimCheck("The $/hour behind the cost table", verdict, detail)


def claim_row_arithmetic(rows: tuple[RowCheck, ...]) -> ClaimCheck:
    problems = [f"{r.row.label}: {p}" for r in rows for p in r.inconsistencies]
    return ClaimCheck("Results-table arithmetic (per-request x 32 = total, B64 gain, "
                      "M tokens/$ = 1/($/M))", "inconsistent" if problems else "holds",
                      "; ".join(problems) or f"all {len(rows)} rows agree within the rounding "
                      "of their printed digits")


def check_study(study: Study, hardware: tuple[str, ...] = IMPLIED_HARDWARE) -> StudyCheck:
    rows = tuple(check_row(r, study, hardware) for r in study.rows)
    claims = [claim_row_arithmetic(rows), claim_smaller_kv(study, rows),
              claim_kv_fills_memory(study, rows), claim_cost_example(study),
              claim_prefix_caching(study, rows), claim_quantise(study),
              claim_descriptions(study), claim_price(rows)]
    return StudyCheck(study, hardware, rows, tuple(c for c in claims if c is not None))
