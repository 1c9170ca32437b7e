"""The roofline: memory fit, decode/prefill time lower bounds and throughput ceilings.

Every time computed here is a LOWER bound (every byte moved at peak bandwidth, every FLOP at peak
rate, nothing else costs time), so every throughput is a CEILING that no engine can beat on the
stated hardware. See docs/plan.md for the assumptions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenmill.cost import usd_per_million

from .dtypes import (
    KV_DTYPES,
    WEIGHT_DTYPES,
    WeightWidths,
    compute_class,
    dtype_bytes,
    weight_widths,
)
from .errors import PlanError
from .hardware import HardwareSpec
from .model_specs import (
    ModelSpec,
    ParamCounts,
    attention_flops_per_context_token,
    kv_elements_per_token,
    param_counts,
)

MAX_SEARCH_BATCH = 1 << 20


@dataclass(frozen=True)
class PlanConfig:
    """How the model is deployed and what workload runs. None = derive a default."""

    num_devices: int = 1
    tp: int | None = None  # default: all devices in one tensor-parallel group
    weight_dtype: str | None = None  # default: the dtype the checkpoint ships in
    kv_dtype: str = "bf16"
    input_len: int = 2048
    output_len: int = 512
    batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    price_per_hour: float | None = None  # per device; default: the catalog price
    reserve_fraction: float = 0.10  # of device memory, for activations/graphs/fragmentation


@dataclass(frozen=True)
class Setup:
    """A validated (model, hardware, config) with the derived per-replica rates.

    Devices form ``replicas`` data-parallel copies of ``tp`` devices each; a replica's bandwidth
    and FLOP/s are tp times one device's.
    """

    model: ModelSpec
    hardware: HardwareSpec
    config: PlanConfig  # fully resolved: no None fields except as documented
    counts: ParamCounts
    widths: WeightWidths  # stored bytes per parameter by role
    kv_replication: int  # copies of each token's KV across a TP group
    replicas: int
    bandwidth: float  # bytes/s per replica
    peak_flops: float  # FLOP/s per replica

    @property
    def kv_bytes_per_token(self) -> float:
        """One logical copy of one token's KV cache."""
        return kv_elements_per_token(self.model) * dtype_bytes(self.config.kv_dtype)

    @property
    def kv_bytes_per_token_stored(self) -> float:
        """What one token costs in memory and reads across its TP group (with replication)."""
        return self.kv_bytes_per_token * self.kv_replication

    @property
    def weight_bytes(self) -> float:
        """One full copy of the weights as stored."""
        c, w = self.counts, self.widths
        return c.embedding * w.embedding + c.lm_head * w.lm_head + c.blocks * w.blocks

    @property
    def output_projection_bytes(self) -> float:
        """The matrix read to produce logits: the lm_head, or the tied embedding table."""
        c, w = self.counts, self.widths
        return c.lm_head * w.lm_head if c.lm_head else c.embedding * w.embedding


def _check_positive(field: str, value: float, minimum: float = 1) -> None:
    if value < minimum:
        raise PlanError(field, f"must be >= {minimum:g}, got {value:g}")


def kv_replication(model: ModelSpec, tp: int) -> int:
    """KV copies across a TP group. GQA: heads are split, and replicated when tp > kv_heads.
    MLA: the latent is shared by all heads, so every rank keeps the whole cache (as vLLM and
    SGLang do without data-parallel attention)."""
    if model.mla is not None:
        return tp
    if model.num_kv_heads % tp == 0:
        return 1
    if tp % model.num_kv_heads == 0:
        return tp // model.num_kv_heads
    raise PlanError("tp", f"tp={tp} and the model's {model.num_kv_heads} KV heads: "
                    "neither divides the other")


def _weight_widths(model: ModelSpec, dtype: str) -> WeightWidths:
    if dtype not in WEIGHT_DTYPES:
        raise PlanError("weight_dtype", f"unknown {dtype!r} (known: {', '.join(WEIGHT_DTYPES)})")
    if dtype != "native":
        return weight_widths(dtype)
    if model.native_widths is None:
        raise PlanError("weight_dtype", "'native' needs a model file with stored tensor sizes "
                        "(a GGUF); choose bf16, fp8, int8 or int4")
    return model.native_widths


def make_setup(model: ModelSpec, hardware: HardwareSpec, config: PlanConfig) -> Setup:
    """Validate the inputs (errors name the field) and resolve defaults."""
    c = config
    _check_positive("num_devices", c.num_devices)
    tp = c.num_devices if c.tp is None else c.tp
    _check_positive("tp", tp)
    if c.num_devices % tp:
        raise PlanError("tp", f"tp={tp} does not divide num_devices={c.num_devices}")
    if model.num_heads % tp:
        raise PlanError("tp", f"tp={tp} does not divide the model's {model.num_heads} "
                        "attention heads")
    if c.kv_dtype not in KV_DTYPES:
        raise PlanError("kv_dtype", f"unknown {c.kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    _check_positive("input_len", c.input_len, 0)
    _check_positive("output_len", c.output_len)
    if not c.batch_sizes:
        raise PlanError("batch_sizes", "need at least one batch size")
    for b in c.batch_sizes:
        _check_positive("batch_sizes", b)
    if not 0 <= c.reserve_fraction < 1:
        raise PlanError("reserve_fraction", f"must be in [0, 1), got {c.reserve_fraction}")
    price = hardware.price_per_hour if c.price_per_hour is None else c.price_per_hour
    _check_positive("price_per_hour", price, 0)
    wdtype = c.weight_dtype or model.default_weight_dtype
    widths = _weight_widths(model, wdtype)
    resolved = replace(c, tp=tp, weight_dtype=wdtype, price_per_hour=price,
                       batch_sizes=tuple(sorted(set(c.batch_sizes))))
    return Setup(model, hardware, resolved, param_counts(model), widths, kv_replication(model, tp),
                 replicas=c.num_devices // tp, bandwidth=hardware.bandwidth_bytes_per_s * tp,
                 peak_flops=hardware.peak_flops(compute_class(wdtype)) * tp)


# --- memory -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: float  # one full copy (per replica)
    weight_bytes_per_device: float
    kv_bytes_per_token: float  # one logical copy
    kv_bytes_per_token_stored: float  # incl. TP replication
    kv_bytes_per_request: float  # stored, at input_len + output_len tokens
    usable_kv_bytes_per_replica: float  # memory - reserve - weights; < 0: weights do not fit
    max_batch: int  # all replicas together


def memory_plan(s: Setup) -> MemoryPlan:
    """Largest batch = (tp x memory x (1 - reserve) - weights) / KV per request, per replica.
    Each request is sized at its final length (input + output): the batch must survive to the
    last decode step without preemption."""
    c = s.config
    tp = c.tp or 1
    per_request = (c.input_len + c.output_len) * s.kv_bytes_per_token_stored
    usable = tp * s.hardware.memory_bytes * (1 - c.reserve_fraction) - s.weight_bytes
    per_replica = max(0, math.floor(usable / per_request)) if usable > 0 else 0
    return MemoryPlan(s.weight_bytes, s.weight_bytes / tp, s.kv_bytes_per_token,
                      s.kv_bytes_per_token_stored, per_request, usable, per_replica * s.replicas)


# --- time bounds --------------------------------------------------------------------------


def expected_experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts one MoE layer reads for ``tokens`` tokens, assuming each token
    picks top_k distinct experts uniformly and independently: E * (1 - (1 - k/E)^tokens).
    Real routers are skewed, which touches FEWER experts; uniform is the pessimistic choice for
    bytes but is what a balanced (auxiliary-loss-trained) router aims at."""
    if tokens <= 0:
        return 0.0
    return float(num_experts * (1 - (1 - top_k / num_experts) ** tokens))


def weight_bytes_read(s: Setup, tokens: float) -> float:
    """Weight bytes one forward pass over ``tokens`` tokens must read.

    The blocks except the routed experts nobody routed to, and the output projection; not the
    untied input embedding table (a lookup reads only ``tokens`` rows, negligible).
    """
    c = s.counts
    blocks: float = c.blocks - c.routed_experts
    if c.num_moe_layers and s.model.moe is not None:
        touched = expected_experts_touched(s.model.moe.num_experts, c.top_k, tokens)
        blocks += c.num_moe_layers * touched * c.expert_params
    return blocks * s.widths.blocks + s.output_projection_bytes


def matmul_flops(c: ParamCounts, tokens: float, logit_rows: float) -> float:
    """Matmul FLOPs (2 per multiply-add) of a forward pass: every token goes through the
    blocks, only the ``logit_rows`` that are sampled from go through the output projection.
    Decode samples every token; prefill only the last of each prompt (engines compute logits
    for those rows alone)."""
    blocks = c.matmul_active - c.output_projection
    return 2 * (blocks * tokens + c.output_projection * logit_rows)


@dataclass(frozen=True)
class StepBound:
    seconds: float
    bytes: float
    flops: float
    bound: str  # "bandwidth" or "compute": the term that sets the time
    kv_bytes: float = 0.0  # the KV-cache part of ``bytes``


def _bound(s: Setup, nbytes: float, flops: float, kv_bytes: float = 0.0) -> StepBound:
    t_mem, t_flop = nbytes / s.bandwidth, flops / s.peak_flops
    return StepBound(max(t_mem, t_flop), nbytes, flops,
                     "compute" if t_flop > t_mem else "bandwidth", kv_bytes)


def average_decode_context(s: Setup) -> float:
    """Decode attends over input + t tokens at step t; the average over the output is input +
    output/2. Time is convex (a max of linear terms) in context, so the average-context step
    time x steps is still a lower bound on the sum (Jensen)."""
    return s.config.input_len + s.config.output_len / 2


def decode_step(s: Setup, batch: int) -> StepBound:
    """One decode step of one replica carrying ``batch`` sequences at the average context."""
    ctx = average_decode_context(s)
    kv = batch * ctx * s.kv_bytes_per_token_stored
    attn = attention_flops_per_context_token(s.model, "decode") * ctx
    flops = matmul_flops(s.counts, batch, batch) + batch * attn
    return _bound(s, weight_bytes_read(s, batch) + kv, flops, kv)


def prefill(s: Setup, batch: int) -> StepBound:
    """Prefill of ``batch`` prompts of input_len tokens on one replica: causal attention gives
    n(n+1)/2 query-key pairs; only the last token of each prompt produces logits; weights are
    read at least once and the new KV written once."""
    n = s.config.input_len
    if n == 0:
        return StepBound(0.0, 0.0, 0.0, "compute")
    attn = attention_flops_per_context_token(s.model, "prefill") * n * (n + 1) / 2
    flops = matmul_flops(s.counts, batch * n, batch) + batch * attn
    nbytes = weight_bytes_read(s, batch * n) + batch * n * s.kv_bytes_per_token_stored
    return _bound(s, nbytes, flops)


# --- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanPoint:
    batch_size: int  # concurrent requests over all replicas
    decode_step_s: float
    decode_bound: str
    decode_tokens_per_s: float  # ceiling, all replicas
    prefill_s: float  # all batch_size prompts
    prefill_tokens_per_s: float  # input tokens / prefill_s
    e2e_tokens_per_s: float  # output tokens / (prefill + decode), run back to back
    e2e_overlap_tokens_per_s: float  # same, if prefill could hide entirely under decode
    usd_per_m_output: float | None  # floor at e2e_tokens_per_s; None: price 0 or does not fit
    fits: bool  # the KV of batch_size requests fits beside the weights
    limit: str  # what caps this point, see point_limit()


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    hardware: HardwareSpec
    config: PlanConfig
    params_total: int
    params_active: int
    memory: MemoryPlan
    fits: bool  # the weights and one request's KV fit on each replica's tp devices
    devices_needed: int | None  # smallest TP group of this hardware that fits; None: none does
    price_per_hour_total: float
    compute_bound_from: int | None  # smallest batch whose decode is compute-bound
    kv_dominates_from: int | None  # smallest batch whose decode reads more KV than weights
    points: tuple[PlanPoint, ...]
    notes: tuple[str, ...] = ()


def plan_point(s: Setup, batch_size: int, max_batch: int) -> PlanPoint:
    c = s.config
    b = math.ceil(batch_size / s.replicas)  # the fullest replica sets the pace
    step, pre = decode_step(s, b), prefill(s, b)
    out = c.output_len
    tokens = batch_size * out
    serial = tokens / (pre.seconds + out * step.seconds)
    overlap_t = max((pre.bytes + out * step.bytes) / s.bandwidth,
                    (pre.flops + out * step.flops) / s.peak_flops)
    price = (c.price_per_hour or 0.0) * c.num_devices
    fits = batch_size <= max_batch
    # a batch that cannot be held has no price: running it needs other hardware
    return PlanPoint(
        batch_size=batch_size, decode_step_s=step.seconds, decode_bound=step.bound,
        decode_tokens_per_s=batch_size / step.seconds, prefill_s=pre.seconds,
        prefill_tokens_per_s=batch_size * c.input_len / pre.seconds if pre.seconds else math.inf,
        e2e_tokens_per_s=serial, e2e_overlap_tokens_per_s=tokens / overlap_t,
        usd_per_m_output=usd_per_million(price, serial) if price > 0 and fits else None,
        fits=fits, limit=point_limit(step, fits))


def point_limit(step: StepBound, fits: bool) -> str:
    """Why a bigger batch stops helping here.

    kv-memory: the batch does not fit. compute: decode is FLOP-bound, tokens/s is flat in the
    batch. kv-bw: most bytes read are KV cache, which grows with the batch, so more requests
    add little. weights-bw: most bytes are weights shared by the batch: batching still pays.
    """
    if not fits:
        return "kv-memory"
    if step.bound == "compute":
        return "compute"
    return "kv-bw" if step.kv_bytes > step.bytes - step.kv_bytes else "weights-bw"


def _first_true(pred: Callable[[int], bool], lo: int = 1,
                hi: int = MAX_SEARCH_BATCH) -> int | None:
    """Smallest n in [lo, hi] with pred(n), for a predicate that stays true once true."""
    n = lo
    while not pred(n):
        if n >= hi:
            return None
        n = min(2 * n, hi)
    low = n // 2 + 1 if n > lo else lo
    while low < n:
        mid = (low + n) // 2
        low, n = (mid + 1, n) if not pred(mid) else (low, mid)
    return n


def _total_batch(s: Setup, per_replica: int) -> int:
    """Smallest total batch whose fullest replica carries ``per_replica`` sequences."""
    return (per_replica - 1) * s.replicas + 1


def compute_bound_from(s: Setup) -> int | None:
    """Smallest total batch at which decode turns compute-bound (None: never, up to 2^20).
    FLOPs grow linearly with the batch and bytes at most linearly once the experts are all
    touched, so the predicate flips once."""
    first = _first_true(lambda b: decode_step(s, b).bound == "compute")
    return None if first is None else _total_batch(s, first)


def kv_dominates_from(s: Setup) -> int | None:
    """Smallest total batch whose decode step reads more KV cache than weights: from there on
    the decode ceiling is over half its large-batch limit and doubling the batch gains < 1/3."""
    def kv_heavier(b: int) -> bool:
        step = decode_step(s, b)
        return step.kv_bytes > step.bytes - step.kv_bytes

    first = _first_true(kv_heavier)
    return None if first is None else _total_batch(s, first)


def min_batch_for(s: Setup, target_tokens_per_s: float, metric: str = "decode") -> int | None:
    """Smallest batch whose decode (or e2e) ceiling reaches the target, ignoring memory."""
    def reaches(b: int) -> bool:
        p = plan_point(s, b, b)
        rate = p.decode_tokens_per_s if metric == "decode" else p.e2e_tokens_per_s
        return rate >= target_tokens_per_s

    return _first_true(reaches)


def devices_needed(s: Setup) -> int | None:
    """Smallest tensor-parallel group of this hardware that holds the weights plus one request
    at input+output tokens, at this dtype and reserve. Only TP sizes the model can be split
    into count (they must divide the attention heads). None: no TP size up to the number of
    heads is enough (e.g. MLA, whose cache every rank stores whole, on small devices)."""
    for tp in range(1, s.model.num_heads + 1):
        try:
            trial = make_setup(s.model, s.hardware, replace(s.config, num_devices=tp, tp=tp))
        except PlanError:  # tp does not divide the heads, or splits the KV heads unevenly
            continue
        if memory_plan(trial).max_batch >= 1:
            return tp
    return None


def make_plan(model: ModelSpec, hardware: HardwareSpec, config: PlanConfig) -> Plan:
    s = make_setup(model, hardware, config)
    mem = memory_plan(s)
    c = s.config
    notes = []
    if model.max_context and c.input_len + c.output_len > model.max_context:
        notes.append(f"input+output {c.input_len + c.output_len} exceeds the model's "
                     f"context of {model.max_context}")
    return Plan(
        model=model, hardware=hardware, config=c, params_total=s.counts.total,
        params_active=s.counts.active, memory=mem, fits=mem.max_batch >= 1,
        devices_needed=devices_needed(s),
        price_per_hour_total=(c.price_per_hour or 0.0) * c.num_devices,
        compute_bound_from=compute_bound_from(s), kv_dominates_from=kv_dominates_from(s),
        points=tuple(plan_point(s, b, mem.max_batch) for b in c.batch_sizes),
        notes=tuple(notes))
