"""`tokenmill run --ray`: the same job, data parallel over a Ray cluster through Ray Data.

The driver (this process) stays the job: runner.py validates the input, claims the output,
skips what earlier runs finished and writes every row. Ray Data only maps blocks of validated
requests to finished rows: `map_batches` on a fixed pool of actors, each holding its own copy of
the job's backend (an engine loaded once per actor, or an endpoint client). Rows stream back to
the driver, which writes each `custom_id` once. So a block that Ray runs again after an actor
died cannot write a request twice, and resuming is the single-machine job's own.

Ray is imported here only inside functions, and this module only when a job runs with --ray.
"""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tokenmill.engine import EngineConfig
from tokenmill.jobs.backends.base import (
    Abortable,
    Backend,
    BackendStats,
    LoadsToCheck,
    ResultSink,
    RowOwner,
    SharesMachine,
    StopFlag,
)
from tokenmill.jobs.errors import JobError, JobFailed
from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.journal.index import IndexEntry
from tokenmill.jobs.journal.rows import ErrorCode
from tokenmill.settings import SettingError, setting
from tokenmill.vllm_engine.config import VllmConfig

if TYPE_CHECKING:
    from tokenmill.jobs.backends.endpoint import EndpointSpec

INSTALL_HINT = "pip install 'tokenmill[ray]'"
POLL_S = 0.1  # how often the driver looks at Ctrl-C while it waits for rows


@dataclass(frozen=True)
class RayOptions:
    address: str | None = setting(
        None, "auto, ray://HOST:10001, … (default: $RAY_ADDRESS, a cluster started on this machine, else a new "
        "local one)", flag="--ray-address")
    replicas: int = setting(1, "Ray actors, each with its own engine (or endpoint client)")
    cpus_per_replica: float = setting(1.0, "CPUs each replica reserves (also its torch threads)")
    gpus_per_replica: float = setting(0.0, "GPUs each replica reserves")
    # The unit Ray retries after an actor dies. None: 4 × what keeps one replica busy
    # (RaySpec.resolved_options).
    batch_size: int | None = setting(
        None, "requests per batch sent to a replica (default 4 × --max-num-seqs, or 4 × its share of "
        "--concurrency); the unit re-run when a replica dies", flag="--ray-batch-size")
    no_progress_timeout_s: float = setting(
        1800.0, "fail when no batch finishes for this many seconds (keep it above the time one batch takes)",
        flag="--no-progress-timeout")

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise SettingError("{replicas} must be >= 1, got {got}", got=self.replicas)
        if self.cpus_per_replica <= 0:
            raise SettingError("{cpus_per_replica} must be > 0, got {got:g}", got=self.cpus_per_replica)
        if self.gpus_per_replica < 0:
            raise SettingError("{gpus_per_replica} must be >= 0, got {got:g}", got=self.gpus_per_replica)
        if self.batch_size is not None and self.batch_size < 1:
            raise SettingError("{batch_size} must be >= 1, got {got}", got=self.batch_size)
        if self.no_progress_timeout_s <= 0:
            raise SettingError("{no_progress_timeout_s} must be > 0, got {got}", got=self.no_progress_timeout_s)


@dataclass(frozen=True)
class RaySpec:
    """The job data parallel on Ray: `options.replicas` actors, each running `replica` — one
    engine, or a client of these endpoints (`concurrency` and each endpoint's `rate_limit` are the
    whole job's, shared out)."""

    replica: EngineConfig | VllmConfig | tuple[EndpointSpec, ...]
    options: RayOptions = field(default_factory=RayOptions)

    def __post_init__(self) -> None:
        if isinstance(self.replica, tuple):
            if not self.replica:
                raise ValueError("RaySpec.replica: a tuple of endpoints needs at least one")
            total = self.replica[0].concurrency
            if total < self.options.replicas:
                raise SettingError("{concurrency} {total} is below {replicas} {replicas_n}: each replica needs at "
                                   "least one request in flight", total=total, replicas_n=self.options.replicas)

    @property
    def endpoint_share(self) -> int:
        """With endpoints: each replica's share of the job's --concurrency (replicas × share <= it)."""
        assert isinstance(self.replica, tuple)
        return self.replica[0].concurrency // self.options.replicas

    def resolved_options(self) -> RayOptions:
        """The options with the batch size decided: 4 × what keeps one replica busy (its engine's
        batch, or its share of the concurrency) unless given."""
        if self.options.batch_size is not None:
            return self.options
        if isinstance(self.replica, tuple):
            busy = self.endpoint_share
        else:
            busy = self.replica.max_num_seqs or EngineConfig.max_num_seqs
        return replace(self.options, batch_size=4 * busy)


class RayBackend:
    """A `Backend` whose work runs on `options.replicas` Ray actors.

    Each actor gets a copy of `backends` (not started: started once in the actor). With several
    (one per endpoint), each batch goes to one of them, picked by its first custom_id.
    """

    def __init__(self, backends: Sequence[Backend], options: RayOptions) -> None:
        if not backends:
            raise ValueError("RayBackend needs at least one backend")
        if options.batch_size is None:
            raise ValueError("RayBackend needs options.batch_size (RaySpec resolves it)")
        try:
            import ray.data  # noqa: F401
        except ImportError as exc:
            raise JobError(f"--ray needs Ray Data ({exc}); install it with {INSTALL_HINT}") from None
        self.backends, self.options = tuple(backends), options
        for backend in self.backends:  # the replicas load the model; this driver only checks bodies
            if isinstance(backend, LoadsToCheck):
                backend.check_without_loading()
        self.kind = backends[0].kind  # the same job as without --ray: a run can resume the other's files
        self.model = backends[0].model
        self._connect_s = 0.0

    def check(self, request: BatchRequest) -> None:
        self.backends[0].check(request)

    def start(self) -> None:
        start = time.monotonic()
        connect(self.options)
        self._connect_s = time.monotonic() - start

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        import ray
        from ray.data.exceptions import ExecutionTimeoutError

        items: list[dict[str, Any]] = []
        # What the rows coming back are written for (not the requests: their items hold their bodies).
        asked: dict[str, RowOwner] = {}
        for request in requests:
            items.append(to_item(request))
            asked[request.custom_id] = RowOwner.of(request)
        totals = BackendStats(replicas=self.options.replicas)
        if not items:
            return totals
        backends_ref = ray.put(self.backends)  # once, not once per actor (and per restart)
        written: set[str] = set()
        try:
            for batch in stream_batches(build_dataset(items, backends_ref, self.options), stop):
                for custom_id, row, stats in zip(batch["custom_id"], batch["row"], batch["stats"], strict=True):
                    if stats:
                        totals.add(BackendStats(**json.loads(stats)))
                    if custom_id not in written:  # a block re-run after an actor died sends rows again
                        written.add(custom_id)
                        sink.row(json.loads(row), asked[custom_id])
        except ExecutionTimeoutError as exc:
            raise JobFailed(f"the Ray job made no progress for {self.options.no_progress_timeout_s:g} s "
                            f"({_first_line(exc)}); {len(written)} row(s) written this run are kept. Check "
                            "`ray status` (replicas asking for more CPUs/GPUs than the cluster has wait "
                            "forever), then re-run the same command to resume") from exc
        except ray.exceptions.RayError as exc:
            raise JobFailed(f"the Ray job failed: {_first_line(exc)}; {len(written)} row(s) written this run "
                            "are kept; re-run the same command to resume") from exc
        totals.load_s += self._connect_s  # the replicas load side by side, after connecting
        return totals


def connect(options: RayOptions) -> None:
    """Join the cluster (or start a local one); warn when it cannot hold the replicas yet."""
    import ray

    if not ray.is_initialized():  # else: a program or test session that already chose its cluster
        try:
            ray.init(address=options.address)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = options.address or "$RAY_ADDRESS / this machine"
            raise JobError(f"cannot join the Ray cluster at {where}: {_first_line(exc)}") from exc
    have = ray.cluster_resources()
    for name, each in (("CPU", options.cpus_per_replica), ("GPU", options.gpus_per_replica)):
        need = each * options.replicas
        if need and have.get(name, 0) < need:
            print(f"tokenmill run: the Ray cluster has {have.get(name, 0):g} {name}(s) now, the {options.replicas} "
                  f"replica(s) need {need:g}; waiting for an autoscaler (the job fails after "
                  f"--no-progress-timeout {options.no_progress_timeout_s:g} s without progress)", file=sys.stderr)


def to_item(request: BatchRequest) -> dict[str, Any]:
    # The body travels as JSON text: Arrow would otherwise infer a struct schema per block, and
    # bodies with different fields would not fit one dataset.
    return {"custom_id": request.custom_id, "line": request.line, "url": request.url,
            "body": json.dumps(request.body, ensure_ascii=False),
            "metadata": json.dumps(request.metadata, ensure_ascii=False)}


def build_dataset(items: list[dict[str, Any]], backends_ref: Any, options: RayOptions) -> Any:
    import ray.data

    # One block per batch: blocks are what Ray hands to actors and re-runs when one dies.
    ds = ray.data.from_items(items, override_num_blocks=math.ceil(len(items) / options.batch_size))
    ds = ds.map_batches(
        Replica, fn_constructor_args=(backends_ref,), batch_size=options.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=options.replicas),
        num_cpus=options.cpus_per_replica, num_gpus=options.gpus_per_replica or None,
    )
    # Actor fault tolerance is Ray Data's default for actor pools (max_restarts=-1,
    # max_task_retries=-1): a dead actor is restarted and its batch runs again.
    ctx = ds.context
    ctx.execution_no_progress_timeout_s = options.no_progress_timeout_s
    ctx.enable_progress_bars = False  # the job has its own progress bar
    ctx.print_on_execution_start = False
    return ds


def stream_batches(dataset: Any, stop: StopFlag) -> Iterator[dict[str, Any]]:
    """The dataset's output batches, as they finish; ends early when `stop` is set.

    Ray is waited on in a thread, so Ctrl-C is seen within POLL_S: the first stops waiting (the
    batches already back are still written; those computing are dropped, and a re-run does
    them), the second stops at once.
    """
    results: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=4)
    cancel = threading.Event()

    def put(kind: str, value: Any) -> None:
        while not cancel.is_set():
            try:
                results.put((kind, value), timeout=POLL_S)
                return
            except queue.Full:
                continue

    def pump() -> None:
        try:
            for batch in dataset.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1):
                put("batch", batch)
                if cancel.is_set():
                    return
            put("end", None)
        except BaseException as exc:  # handed to the driver's thread, which raises it
            put("error", exc)

    threading.Thread(target=pump, name="tokenmill-ray-rows", daemon=True).start()
    try:
        while not stop.forced:
            try:
                kind, value = results.get(timeout=POLL_S)
            except queue.Empty:
                if stop.requested:
                    return
                continue
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        cancel.set()


class Replica:
    """One Ray actor: its copy of the backend(s), started once, serving batch after batch."""

    def __init__(self, backends: Any) -> None:
        import ray

        if isinstance(backends, ray.ObjectRef):
            backends = ray.get(backends)
        start = time.monotonic()
        share = machine_share() if ray.is_initialized() and ray.get_runtime_context().get_actor_id() else 1.0
        for backend in backends:
            if isinstance(backend, SharesMachine):
                backend.share_machine(share)
            backend.start()
        self.backends: tuple[Backend, ...] = tuple(backends)
        self.load_s = time.monotonic() - start  # reported with this actor's first batch

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        requests = [BatchRequest(int(line), str(cid), str(url), json.loads(body), metadata=json.loads(metadata))
                    for cid, line, url, body, metadata in zip(batch["custom_id"], batch["line"], batch["url"],
                                                              batch["body"], batch["metadata"], strict=True)]
        if not requests:
            return {"custom_id": [], "row": [], "stats": []}
        backend = self.backends[zlib.crc32(requests[0].custom_id.encode()) % len(self.backends)]
        rows, stats = serve_batch(backend, requests)
        stats.load_s, self.load_s = self.load_s, 0.0
        # The batch's stats ride on its first row, so they arrive (and count) with its rows.
        return {"custom_id": [r["custom_id"] for r in rows],
                "row": [json.dumps(r, ensure_ascii=False) for r in rows],
                "stats": [json.dumps(asdict(stats))] + [""] * (len(rows) - 1)}


def machine_share() -> float:
    """This actor's part of its node: of the node's GPUs when it has GPUs (per device), else of
    its CPUs. Replicas that start together each see the same free memory; without this, four
    CPU replicas on one node would each size their KV cache for 40 % of it."""
    import ray

    context = ray.get_runtime_context()
    mine = context.get_assigned_resources()
    if mine.get("GPU"):
        return min(1.0, mine["GPU"])
    node = next((n["Resources"] for n in ray.nodes() if n["NodeID"] == context.get_node_id()), {})
    return min(1.0, mine.get("CPU", 1.0) / max(node.get("CPU", 1.0), 1.0))


class RowList(list[dict[str, Any]]):
    """A `RowWriter` that keeps rows in memory, for a replica to send back."""

    def write(self, row: dict[str, Any], entry: IndexEntry | None = None) -> None:
        self.append(row)  # the driver writes the row, and its index entry, when it comes back


def serve_batch(backend: Backend, requests: list[BatchRequest]) -> tuple[list[dict[str, Any]], BackendStats]:
    """One row per request, whatever the backend does.

    Ray drops a whole block when a map function raises, so an exception is turned into rows here:
    the requests still unanswered run again one at a time, and one that still raises alone gets a
    `worker_error` row (transient: a re-run tries it again).
    """
    rows = RowList()
    sink = ResultSink(rows, rows, None)
    try:
        return rows, backend.run(iter(requests), sink, StopFlag())
    except Exception:  # one request's failure must not cost the batch: isolate it below
        _abort(backend, requests)
    stats = BackendStats()
    answered = {row["custom_id"] for row in rows}
    for request in requests:
        if request.custom_id in answered:
            continue
        try:
            stats.add(backend.run(iter([request]), sink, StopFlag()))
        except Exception as exc:
            _abort(backend, [request])
            sink.error(request, ErrorCode.WORKER_ERROR, f"the worker's backend failed on this request: "
                                              f"{type(exc).__name__}: {exc}")
    return rows, stats


def _abort(backend: Backend, requests: list[BatchRequest]) -> None:
    """Clear what a failed `run` left inside the engine, so the next run starts clean."""
    if isinstance(backend, Abortable):
        backend.abort(r.custom_id for r in requests)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
