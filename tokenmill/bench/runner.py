"""The sweep: warm-up, then for each batch size `runs` runs on fresh prompts, median reported."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenmill.bench.metrics import PointResult, RequestRecord, add_gains, median_point, summarize
from tokenmill.bench.workloads import Corpus, LengthSpec, Request, Workload


@dataclass
class RunOutcome:
    """What a target hands back for one run: every request's timeline, and what only it can see."""

    records: list[RequestRecord]
    wall_s: float
    peak_kv_usage: float | None = None
    preemptions: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Target(Protocol):
    kind: str
    label: str

    @property
    def tokenizer(self) -> Any: ...

    def describe(self) -> dict[str, Any]: ...

    def run(self, requests: list[Request], batch_size: int) -> RunOutcome: ...


@dataclass
class SweepConfig:
    batch_sizes: list[int]
    runs: int = 3
    num_requests: int | None = None  # requests per run; None = the batch size (one full wave)
    warmup: int = 2  # warm-up requests before the sweep, not counted
    seed: int = 0
    price_per_hour: float | None = None
    price_source: str | None = None  # "--price-per-hour" or the catalog hardware name
    preset: str | None = None

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive integers, got {self.batch_sizes}")
        if self.runs < 1:
            raise ValueError(f"runs must be >= 1, got {self.runs}")


@dataclass
class RunData:
    point: PointResult
    records: list[RequestRecord]
    extra: dict[str, Any]


@dataclass
class SweepResult:
    target: dict[str, Any]
    label: str
    workload: Workload
    config: SweepConfig
    environment: dict[str, Any]
    points: list[PointResult] = field(default_factory=list)  # medians, one per batch size
    runs: dict[int, list[RunData]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def run_sweep(target: Target, workload: Workload, cfg: SweepConfig,
              log: Callable[[str], None] = print) -> SweepResult:
    result = SweepResult(target.describe(), target.label, workload, cfg, environment())
    rng = random.Random(cfg.seed)
    corpus = Corpus(target.tokenizer, cfg.seed) if workload.jsonl is None else None
    if cfg.warmup:
        log(f"warm-up: {cfg.warmup} request(s), not counted")
        # At most the largest batch of the sweep runs at once: the engine is sized for that.
        target.run(_warmup_requests(workload, cfg.warmup, corpus, rng, target.tokenizer),
                   min(cfg.warmup, max(cfg.batch_sizes)))
    for batch in sorted(set(cfg.batch_sizes)):
        runs = [_one_run(target, workload, cfg, batch, corpus, rng, i, log) for i in range(cfg.runs)]
        result.runs[batch] = runs
        point = median_point([r.point for r in runs])
        result.points.append(point)
        result.warnings += _check(point, workload)
    add_gains(result.points)
    for w in result.warnings:
        log(f"warning: {w}")
    return result


def _warmup_requests(workload: Workload, n: int, corpus: Corpus | None, rng: random.Random,
                     tokenizer: Any) -> list[Request]:
    # Same input lengths, short outputs: warms kernels, allocators and connections cheaply.
    short = Workload(workload.input, LengthSpec(min(workload.output.mean, 8)), jsonl=workload.jsonl)
    return short.make(n, corpus, rng, tokenizer)  # type: ignore[arg-type]


def _one_run(target: Target, workload: Workload, cfg: SweepConfig, batch: int, corpus: Corpus | None,
             rng: random.Random, index: int, log: Callable[[str], None]) -> RunData:
    n = cfg.num_requests or batch
    requests = workload.make(n, corpus, rng, target.tokenizer)  # type: ignore[arg-type]
    cpu = CpuMeter()
    outcome = target.run(requests, batch)
    point = summarize(batch, outcome.records, outcome.wall_s)
    point.peak_kv_usage, point.preemptions = outcome.peak_kv_usage, outcome.preemptions
    point.other_cpu_s = cpu.other_seconds()
    log(f"batch {batch} run {index + 1}/{cfg.runs}: {point.output_tokens_per_s:,.1f} out tok/s, "
        f"{point.num_failed} failed, {point.wall_s:.1f} s, other CPU {point.other_cpu_s:.1f} s")
    return RunData(point, outcome.records, outcome.extra)


def _check(point: PointResult, workload: Workload) -> list[str]:
    warnings = []
    b = point.batch_size
    if point.num_failed:
        warnings.append(f"batch {b}: {point.num_failed} request(s) failed (median run)")
    if point.cached_tokens and not workload.expects_cache_hits:
        warnings.append(f"batch {b}: {point.cached_tokens} prompt tokens came from a prefix cache "
                        "although prompts were fresh; prefill numbers are flattered")
    if point.shape_mismatches:
        warnings.append(f"batch {b}: {point.shape_mismatches} request(s) differ from the requested "
                        f"lengths (actual mean in {point.input_len_mean:.1f} / out {point.output_len_mean:.1f})")
    return warnings


class CpuMeter:
    """CPU seconds other processes used since creation: a busy machine ruins CPU benchmarks. This
    process's children count as its own (vLLM's engine runs in one)."""

    def __init__(self) -> None:
        self.busy0, self.own0 = _busy_seconds(), _own_cpu_seconds()

    def other_seconds(self) -> float | None:
        busy = _busy_seconds()
        if busy is None or self.busy0 is None:
            return None
        return max(0.0, round(busy - self.busy0 - (_own_cpu_seconds() - self.own0), 2))


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(cpu) - cpu[3] - cpu[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _own_cpu_seconds() -> float:
    """This process (threads included), the children it has waited for (a benchmarked tool run as a
    subprocess), and every live process under it."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _descendants_cpu_seconds(os.getpid())


def _descendants_cpu_seconds(root: int) -> float:
    parents, ticks = {}, {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after "pid (comm)": state, ppid, ...
        except OSError:  # gone meanwhile
            continue
        pid = int(entry.name)
        parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])  # ppid; utime + stime
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        total += ticks[pid]
        stack.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": platform.platform(), "python": platform.python_version(),
        "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "tokenmill": _version("tokenmill"), "transformers": _version("transformers"),
        "aiohttp": _version("aiohttp"),
    }
    with contextlib.suppress(OSError):
        env["loadavg_at_start"] = os.getloadavg()
    return env


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
