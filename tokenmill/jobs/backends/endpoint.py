"""The HTTP backend: OpenAI-compatible servers (vLLM, SGLang, a hosted API, tokenmill serve).

Each endpoint gets `concurrency` workers, and every worker takes the next request from the one
shared input and POSTs its body, so a faster endpoint takes more rows without weights to tune.
429, 5xx, timeouts and dropped connections are retried with exponential backoff and jitter
(Retry-After honoured) for up to `retry_for` seconds; any other 4xx is the request's own fault
and is recorded as its final error. Each endpoint has a circuit breaker (`Breaker`) that notices
when it is down (a server restarting): its workers stop launching requests, the requests they
hold go back to the shared work for the other endpoints (or this one, once back), one probe at a
time asks whether it is back, and an endpoint down for `retry_for` is left for the rest of the
run; the job ends (resumable) when every endpoint is. Optional rate limits per endpoint
(rate_limit.py) pace its workers, and a 429 with Retry-After pauses all of them.

The client is aiohttp, bodies go out and come back through orjson: at a fast server the job
layer's own cost per request is what limits a job (docs/jobs.md has the measurements against a
minimal client; httpx cost ~10× more per request here).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tokenmill.environment import CLIENT_API_KEY_ENV
from tokenmill.http_client import client_session, describe_error
from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag, notice
from tokenmill.jobs.backends.http import DOWN_STATUSES, TIMEOUT_S, RetryPolicy, code_of_status, error_message
from tokenmill.jobs.backends.rate_limit import Limiter, RateLimit, sleep_unless
from tokenmill.jobs.errors import JobFailed
from tokenmill.jobs.input.request import BatchRequest
from tokenmill.jobs.journal.rows import ErrorCode, is_transient
from tokenmill.openai_compat import api_root, is_response_body, new_id, response_kind
from tokenmill.settings import SettingError, setting

PROBE_PATH = "/v1/models"  # cheap, and served by every OpenAI-compatible server we know


@dataclass
class Attempt:
    """One HTTP try: a body on success, else a code and message, and whether to try again."""

    body: dict[str, Any] | None = None
    request_id: str | None = None
    code: str = ""
    message: str = ""
    retry: bool = False
    retry_after: float | None = None
    response: dict[str, Any] | None = None  # status_code, request_id, body of an HTTP error
    down: bool = False  # the failure says the endpoint may be down (see Breaker)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds (`120`) or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


@dataclass(frozen=True)
class EndpointSpec:
    """An OpenAI-compatible server (vLLM, SGLang, a hosted API, tokenmill serve). `model`: the name
    sent in every body (None: each row's own). A job may have several (`EndpointBackend`): each
    one's numbers are its own."""

    url: str
    model: str | None = None
    api_key: str | None = setting(None, f"bearer token (default: ${' or $'.join(CLIENT_API_KEY_ENV)})")
    concurrency: int = setting(16, "requests in flight to each endpoint (with --ray: in all replicas together)")
    timeout_s: float = setting(TIMEOUT_S, "seconds per attempt", flag="--timeout")
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    rate_limit: RateLimit = field(default_factory=RateLimit)

    def __post_init__(self) -> None:
        check_server(self.url, self.timeout_s)
        if self.concurrency <= 0:
            raise SettingError("{concurrency} must be positive, got {got}", got=self.concurrency)


def check_server(url: str, timeout_s: float) -> None:
    """What every spec of an OpenAI-compatible server asks of its URL and per-call timeout
    (EndpointSpec, and batch_api.BatchApiSpec): SettingError naming the field."""
    if not url.startswith(("http://", "https://")):
        raise SettingError("{url} must be an http:// or https:// URL, got {got!r}", got=url)
    if timeout_s <= 0:
        raise SettingError("{timeout_s} must be positive, got {got:g}", got=timeout_s)


class Breaker:
    """One endpoint's circuit breaker: whether it is up, as all its workers see it.

    Closed, requests go out. `breaker_after` down signals in a row (refused, reset or dropped
    connections, timeouts, 502/503/504; any other reply in between resets the count) open it:
    no worker of this endpoint starts an attempt, and one probe at a time (GET /v1/models, with
    backoff) asks whether it is back; its first answer (any status but those three; a 401 or 404
    still means the server is up) closes the breaker. Replies to requests that were in flight
    when it opened do not: they were sent before the outage. Open for `retry_for` seconds: the
    endpoint is `gone` (`on_gone` is called) and its waiting workers stop.
    """

    def __init__(
        self, url: str, policy: RetryPolicy, probe: Callable[[], Awaitable[str | None]], halt: asyncio.Event,
        on_gone: Callable[[], None] = lambda: None,
    ) -> None:
        self.url, self.policy, self._probe, self._halt, self._on_gone = url, policy, probe, halt, on_gone
        self._closed = asyncio.Event()
        self._closed.set()
        self._gone = asyncio.Event()
        self._streak = 0
        self.opened_at: float | None = None
        self._down_before = 0.0  # seconds open in this run's earlier outages
        self.last_error = ""
        self._prober: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def gone(self) -> bool:
        return self._gone.is_set()

    def down_s(self) -> float:
        """Seconds the breaker has been open in this run so far: time no request is blamed for."""
        return self._down_before + (0.0 if self.opened_at is None else time.monotonic() - self.opened_at)

    def report(self, result: Attempt) -> None:
        if not result.down:
            self._streak = 0
            return
        self._streak += 1
        self.last_error = result.message
        if self._streak >= self.policy.breaker_after:
            self.open()

    def open(self) -> None:
        if self.opened_at is not None or self.gone:
            return
        self.opened_at = time.monotonic()
        self._closed.clear()
        self._prober = asyncio.create_task(self._probe_until_back(self.opened_at))
        notice(f"the endpoint {self.url} is not answering ({self.last_error}); holding new requests and "
             f"probing it for up to {self.policy.retry_for:g} s (--retry-for)")

    def give_up(self, error: str) -> None:
        """The endpoint is gone: its workers stop waiting, and take no more requests this run."""
        self.last_error = error
        self._closed.clear()
        self._gone.set()
        self._on_gone()

    async def wait(self) -> bool:
        """Wait while the breaker is open; True to go on, False when the endpoint is gone or the job halts."""
        if not self._closed.is_set():
            await _wait_any(self._closed, self._gone, self._halt)
        return not (self._halt.is_set() or self._gone.is_set())

    def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()

    def _close(self, opened_at: float) -> None:
        down = time.monotonic() - opened_at
        self._down_before += down
        self.opened_at, self._streak = None, 0
        self._closed.set()
        notice(f"the endpoint {self.url} answers again after {down:.1f} s; resuming")

    async def _probe_until_back(self, opened_at: float) -> None:
        deadline = opened_at + self.policy.retry_for
        for probes in itertools.count():
            # The last probe goes out at the deadline, so a server back just in time still counts.
            wait = min(self.policy.probe_delay(probes), max(0.0, deadline - time.monotonic()))
            if await sleep_unless(self._halt, wait):
                return
            error = await self._probe()
            if self._halt.is_set():  # the job ended meanwhile: nothing to give up on
                return
            if error is None:
                self._close(opened_at)
                return
            self.last_error = error
            if time.monotonic() >= deadline:
                self.give_up(error)
                return


class _Endpoint:
    """One server as the backend keeps it from run to run: its spec, its rate limiter, and
    whether the last run gave up on it."""

    def __init__(self, spec: EndpointSpec) -> None:
        self.base_url = api_root(spec.url)
        self.spec = spec
        self.limiter = Limiter(spec.rate_limit)
        # The last run gave up on it: the next starts with one probe, and leaves it out at once if
        # that fails (a Ray replica runs batch after batch, and each failed one again alone).
        self.gone = False


@dataclass
class _Lane:
    """One endpoint in one run: its connections, its breaker, what it did."""

    endpoint: _Endpoint
    client: aiohttp.ClientSession
    breaker: Breaker
    rows: int = 0  # rows (results and final errors) its workers wrote
    retries: int = 0  # attempts beyond each request's first


class _Work:
    """The requests all endpoints' workers share: first those handed back by an endpoint that went
    down (with the attempts and the budget they spent there), then the input's, read as needed.

    A request taken is open until its row is written. `halt` is set once the input is read to its
    end and no request is open, so workers waiting for a handed-back request stop.
    """

    def __init__(self, requests: Iterator[BatchRequest], halt: asyncio.Event) -> None:
        self._requests, self._halt = requests, halt
        self._handed_back: deque[tuple[BatchRequest, int, float]] = deque()
        self._handed = asyncio.Event()
        self._open = 0
        self._read_all = False

    async def take(self) -> tuple[BatchRequest, int, float] | None:
        """(request, attempts so far, seconds of budget spent), or None when there is no more work."""
        while not self._halt.is_set():
            if self._handed_back:
                return self._handed_back.popleft()
            if not self._read_all:
                request = next(self._requests, None)  # one thread: workers take turns without a lock
                if request is not None:
                    self._open += 1
                    return request, 0, 0.0
                self._read_all = True
                self._settle()
                continue
            # Read to the end, but requests are open elsewhere: one may yet be handed back.
            self._handed.clear()
            await _wait_any(self._handed, self._halt)
        return None

    def hand_back(self, request: BatchRequest, attempts: int, spent_s: float) -> None:
        self._handed_back.append((request, attempts, spent_s))
        self._handed.set()

    def written(self) -> None:
        """An open request has its row."""
        self._open -= 1
        self._settle()

    def _settle(self) -> None:
        if self._read_all and not self._open:
            self._halt.set()


@dataclass
class _Run:
    """What the workers of one `run` share."""

    work: _Work
    sink: ResultSink
    stop: StopFlag
    halt: asyncio.Event  # a stop signal, every endpoint gone, or all work written: every sleep and wait ends
    lanes: list[_Lane]


class EndpointBackend:
    kind = "endpoint"

    def __init__(self, spec: EndpointSpec | Sequence[EndpointSpec], *, seed: int | None = None) -> None:
        """One endpoint, or several that share the job's rows. `seed`: the retry jitter's (tests)."""
        specs = [spec] if isinstance(spec, EndpointSpec) else list(spec)
        if not specs:
            raise ValueError("EndpointBackend needs at least one endpoint")
        if len({s.model for s in specs}) > 1:
            raise ValueError("the endpoints of one job must send the same --model")
        self.endpoints = [_Endpoint(s) for s in specs]
        self.model = specs[0].model or "as in each request"
        self._rng = random.Random(seed)

    def check(self, request: BatchRequest) -> None:
        """The server has the last word on what it supports."""

    def start(self) -> None:
        """Connections are opened per run."""

    def unreachable(self) -> str | None:
        """One probe of each endpoint now: None when any answers, else why not (`tokenmill choose`
        asks before a candidate's run, so servers that are down cost one probe, not --retry-for)."""
        async def probe(endpoint: _Endpoint) -> str | None:
            async with _session(endpoint, limit=1) as client:
                return await _probe(endpoint, client)

        async def probe_all() -> list[str | None]:
            return await asyncio.gather(*(probe(endpoint) for endpoint in self.endpoints))

        errors = asyncio.run(probe_all())
        if any(error is None for error in errors):
            return None
        if len(errors) == 1:
            return errors[0]
        return "; ".join(f"{e.base_url}: {error}" for e, error in zip(self.endpoints, errors, strict=True))

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        before = sink.done + sink.failed
        lanes = asyncio.run(self._run(requests, sink, stop))
        for lane in lanes:
            lane.endpoint.gone = lane.breaker.gone
        if all(lane.breaker.gone for lane in lanes):
            raise JobFailed(f"{_gone_text(lanes)}; the {sink.done + sink.failed - before} row(s) written this run "
                            "are kept and the requests not done were left for the next run: once the server is up, "
                            "re-run the same command to resume")
        return BackendStats(retries=sum(lane.retries for lane in lanes),
                            rows_by_endpoint={lane.endpoint.base_url: lane.rows for lane in lanes})

    async def _run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> list[_Lane]:
        halt = asyncio.Event()
        run = _Run(_Work(requests, halt), sink, stop, halt, [])
        async with contextlib.AsyncExitStack() as sessions:
            for endpoint in self.endpoints:
                # One connection more than workers: the breaker's probe never waits for a busy pool.
                client = await sessions.enter_async_context(_session(endpoint, endpoint.spec.concurrency + 1))
                run.lanes.append(_lane(run, endpoint, client))
            # Given up on by the last run: one probe each, not another --retry-for, before any work.
            await asyncio.gather(*(_recheck(lane) for lane in run.lanes if lane.endpoint.gone))
            workers = [asyncio.create_task(self._worker(run, lane))
                       for lane in run.lanes if not lane.breaker.gone for _ in range(lane.endpoint.spec.concurrency)]
            watcher = asyncio.create_task(_watch(stop, halt, workers))
            if workers:
                await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
                halt.set()  # all done, or a worker's bug: the others stop waiting
                await asyncio.wait(workers)
            watcher.cancel()
            for lane in run.lanes:
                lane.breaker.stop()
        # A bug in a worker, or a full disk, must not pass silently; every worker's error is
        # retrieved (asyncio prints the ones that are not), the first raised.
        failed = [error for task in workers if not task.cancelled() and (error := task.exception()) is not None]
        if failed:
            raise failed[0]
        return run.lanes

    async def _worker(self, run: _Run, lane: _Lane) -> None:
        # No new request while the breaker is open: a dead endpoint holds its workers, not 16 retry loops.
        while not run.stop.requested and await lane.breaker.wait():
            taken = await run.work.take()
            if taken is None:
                return
            await self._serve(run, lane, *taken)

    async def _serve(self, run: _Run, lane: _Lane, request: BatchRequest, attempts: int, spent_before: float) -> None:
        """Try until the outcome is final or the request's budget is spent. Hand it back to the
        shared work when this endpoint's breaker is open (another endpoint, or this one once back,
        goes on with it); return without a row (not done: a re-run does it) when the job halts."""
        policy, breaker, limiter = lane.endpoint.spec.retry, lane.breaker, lane.endpoint.limiter
        started, down_before = time.monotonic(), breaker.down_s()
        attempt = attempts
        while True:
            if not breaker.closed:
                run.work.hand_back(request, attempt, _spent_s(breaker, spent_before, started, down_before))
                return
            if limiter.needed and not await limiter.turn(request, run.halt):
                return
            attempt += 1
            if attempt > 1:
                lane.retries += 1
            result = await self._attempt(lane, request)
            breaker.report(result)
            if result.body is not None:
                run.sink.result(request, result.body, result.request_id)
                return _written(run, lane)
            if not result.retry:
                run.sink.error(request, result.code, result.message, result.response)
                return _written(run, lane)
            delay = policy.delay(attempt, result.retry_after, self._rng)
            if result.code == ErrorCode.RATE_LIMITED and result.retry_after is not None:
                limiter.pause(delay)  # the endpoint asked for a pause: all its workers hold, not just this one
            spent = _spent_s(breaker, spent_before, started, down_before)
            if policy.exhausted(attempt, spent + delay):
                break
            # Endpoint down: hand the request back now (the loop's top), for an endpoint that is up.
            if breaker.closed and await sleep_unless(run.halt, delay):
                return
        message = f"{result.message} (gave up after {attempt} attempt(s) in {spent:.1f} s)"
        run.sink.error(request, result.code, message, result.response)
        _written(run, lane)

    async def _attempt(self, lane: _Lane, request: BatchRequest) -> Attempt:
        try:
            async with lane.client.post(request.url.lstrip("/"), data=orjson.dumps(request.body)) as reply:
                raw = await reply.read()
        except TimeoutError as exc:
            return Attempt(code=ErrorCode.TIMEOUT, retry=True, down=True,
                           message=f"no reply within {lane.endpoint.spec.timeout_s:g} s ({type(exc).__name__})")
        except aiohttp.ClientError as exc:  # refused, reset, dropped mid-reply
            return Attempt(code=ErrorCode.CONNECTION_ERROR, message=describe_error(exc), retry=True, down=True)
        request_id = reply.headers.get("x-request-id") or new_id("req_")
        body = _json_or_none(raw)
        if 200 <= reply.status < 300:
            if not is_response_body(request.url, body):
                return Attempt(code=ErrorCode.BAD_RESPONSE, retry=True,
                               message=f"HTTP {reply.status} without {response_kind(request.url)}")
            assert isinstance(body, dict)
            return Attempt(body=body, request_id=request_id)
        text = raw.decode("utf-8", "replace")
        response = {"status_code": reply.status, "request_id": request_id,
                    "body": body if body is not None else text[:2000]}
        code = code_of_status(reply.status)
        return Attempt(code=code, message=f"HTTP {reply.status}: {error_message(body, text)}", retry=is_transient(code),
                       retry_after=parse_retry_after(reply.headers.get("retry-after")), response=response,
                       down=reply.status in DOWN_STATUSES)


def _session(endpoint: _Endpoint, limit: int) -> aiohttp.ClientSession:
    spec = endpoint.spec
    return client_session(endpoint.base_url, aiohttp.ClientTimeout(total=spec.timeout_s), limit, spec.api_key,
                          headers={"Content-Type": "application/json"}, json_serialize=_json_text)


async def _probe(endpoint: _Endpoint, client: aiohttp.ClientSession) -> str | None:
    """None when the endpoint answers at all (a 401 or 404 too: it is up), else why not."""
    timeout = aiohttp.ClientTimeout(total=min(endpoint.spec.timeout_s, endpoint.spec.retry.probe_timeout))
    try:
        async with client.get(PROBE_PATH.lstrip("/"), timeout=timeout) as reply:
            status = reply.status
    except Exception as exc:  # whatever keeps it from answering is a failed probe, named in the end
        return describe_error(exc)
    return f"HTTP {status} from GET {PROBE_PATH}" if status in DOWN_STATUSES else None


def _lane(run: _Run, endpoint: _Endpoint, client: aiohttp.ClientSession) -> _Lane:
    breaker = Breaker(endpoint.base_url, endpoint.spec.retry, lambda: _probe(endpoint, client), run.halt,
                      on_gone=lambda: _lane_gone(run, lane))
    lane = _Lane(endpoint, client, breaker)
    endpoint.limiter.begin_run()
    return lane


async def _recheck(lane: _Lane) -> None:
    if (error := await _probe(lane.endpoint, lane.client)) is not None:
        lane.breaker.give_up(error)  # still down: left out of this run at once


def _written(run: _Run, lane: _Lane) -> None:
    lane.rows += 1
    run.work.written()


def _spent_s(breaker: Breaker, spent_before: float, started: float, down_before: float) -> float:
    """A request's budget spent: time the breaker was open is the outage's, not the request's."""
    return spent_before + time.monotonic() - started - (breaker.down_s() - down_before)


def _lane_gone(run: _Run, lane: _Lane) -> None:
    """An endpoint down for --retry-for: the others carry on with its requests, or the job ends."""
    up = [other for other in run.lanes if not other.breaker.gone]
    if not up:
        run.halt.set()
        return
    notice(f"{_gone_text([lane])}; leaving it for the rest of this run: {len(up)} other endpoint(s) carry on "
         "with its requests")


def _gone_text(lanes: list[_Lane]) -> str:
    retry_for = max(lane.endpoint.spec.retry.retry_for for lane in lanes)
    if len(lanes) == 1:
        [lane] = lanes
        return (f"the endpoint {lane.endpoint.base_url} has not answered for {retry_for:g} s (--retry-for; "
                f"last error: {lane.breaker.last_error})")
    errors = "; ".join(f"{lane.endpoint.base_url}: {lane.breaker.last_error}" for lane in lanes)
    return f"none of the {len(lanes)} endpoints has answered for {retry_for:g} s (--retry-for; last errors: {errors})"


async def _watch(stop: StopFlag, halt: asyncio.Event, workers: list[asyncio.Task[None]]) -> None:
    """Turn the signal flags into asyncio: wake sleepers on the first, cancel in-flight on the second."""
    while True:
        if stop.requested:
            halt.set()
        if stop.forced:
            for task in workers:
                task.cancel()
            return
        await asyncio.sleep(0.05)


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _json_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()
