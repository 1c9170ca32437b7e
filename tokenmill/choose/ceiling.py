"""`--hardware`: what an embedded candidate's model could at best do on other hardware, from the
planner's roofline. A ceiling (memory bandwidth, compute, KV memory), never a measurement."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.choose.results import CandidateResult, Ceiling
from tokenmill.cost import SECONDS_PER_HOUR
from tokenmill.plan import PlanConfig, PlanError, get_hardware, load_model, make_plan

MAX_BATCH = 1024  # beyond this a batch job gains little and the planner's KV sizing is the only limit


def ceiling(model_ref: str | None, hardware: str, prompt_len: int, output_len: int, rows: int) -> Ceiling:
    """At the largest batch whose KV fits (at most the job's rows, at most MAX_BATCH), requests of
    the job's mean prompt and output length; the hardware's catalog price. Raises PlanError."""
    model, spec = load_model(model_ref), get_hardware(hardware)
    shape = PlanConfig(input_len=max(1, prompt_len), output_len=max(1, output_len), batch_sizes=(1,))
    fits = make_plan(model, spec, shape).memory.max_batch
    batch = max(1, min(fits, rows, MAX_BATCH))
    plan = make_plan(model, spec, replace(shape, batch_sizes=(batch,)))
    point = plan.points[0]
    price = plan.price_per_hour_total
    job_s = output_len * rows / point.e2e_tokens_per_s
    return Ceiling(spec.name, batch, round(point.e2e_tokens_per_s, 1), point.usd_per_m_output,
                   price * job_s / SECONDS_PER_HOUR if price else None)


def add_ceilings(results: list[CandidateResult], models: dict[str, str | None], hardware: str) -> list[str]:
    """Set `.ceiling` on each in-process candidate (embedded or vLLM engine: the model is known)
    that has a projection; returns warnings for those the planner cannot model."""
    warnings = []
    for result in results:
        if result.backend not in ("embedded", "vllm") or result.projected is None:
            continue
        p = result.projected
        try:
            result.ceiling = ceiling(models.get(result.name), hardware, p.prompt_tokens // p.rows,
                                     p.output_tokens // p.rows, p.rows)
        except PlanError as exc:
            warnings.append(f"{result.name}: no ceiling on {hardware}: {exc}")
    return warnings
