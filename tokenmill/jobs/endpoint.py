"""The HTTP backend: any OpenAI-compatible server (vLLM, SGLang, a hosted API, tokenmill serve).

`concurrency` workers each take the next request and POST its body. 429, 5xx, timeouts and
dropped connections are retried with exponential backoff and jitter (Retry-After honoured) for
up to `retry_for` seconds; any other 4xx is the request's own fault and is recorded as its final
error. A job-wide circuit breaker (`Breaker`) notices when the endpoint itself is down (a server
restarting): workers stop launching requests, one probe at a time asks whether it is back, and
the job ends (resumable) if it stays down for `retry_for`.

The client is aiohttp, bodies go out and come back through orjson: at a fast server the job
layer's own cost per request is what limits a job (docs/jobs.md has the measurements against a
minimal client; httpx cost ~10× more per request here).
"""

from __future__ import annotations

import asyncio
import email.utils
import itertools
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from tokenmill.jobs.backend import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.output import JobFailed
from tokenmill.jobs.spec import BatchRequest
from tokenmill.openai_compat import new_id

DOWN_STATUSES = frozenset({502, 503, 504})  # a gateway saying the server behind it is not there
PROBE_PATH = "/v1/models"  # cheap, and served by every OpenAI-compatible server we know


@dataclass(frozen=True)
class RetryPolicy:
    """Every number that decides how long the endpoint backend keeps trying."""

    retry_for: float = 600.0  # a request's retry budget, and how long the endpoint may be down
    max_attempts: int | None = None  # an optional extra cap on one request's tries
    base_delay: float = 0.5  # seconds before the 2nd attempt, and before the first probe (then doubled)
    max_delay: float = 30.0  # cap on one request's backoff
    max_retry_after: float = 300.0  # cap on what a server may ask us to wait
    breaker_after: int = 3  # down signals in a row, job-wide, that open the breaker
    max_probe_delay: float = 5.0  # cap on the wait between probes: how late we may notice a return
    probe_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.retry_for < 0:
            raise ValueError(f"--retry-for must be >= 0, got {self.retry_for:g}")

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """Equal jitter: half the exponential delay for sure, the other half at random, so
        workers that failed together do not come back together."""
        delay = min(self.max_delay, self.base_delay * 2 ** (attempt - 1))
        return delay / 2 + rng.uniform(0, delay / 2)

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """The wait after a failed `attempt`: the server's Retry-After (capped), else the backoff."""
        return self.backoff(attempt, rng) if retry_after is None else min(retry_after, self.max_retry_after)

    def exhausted(self, attempts: int, spent_s: float) -> bool:
        """Whether a request that failed `attempts` times, and would have spent `spent_s` of its
        budget by its next try, should stop here."""
        return spent_s > self.retry_for or (self.max_attempts is not None and attempts >= self.max_attempts)

    def probe_delay(self, probes: int) -> float:
        return min(self.max_probe_delay, self.base_delay * 2**probes)


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
    sent in every body (None: each row's own)."""

    url: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 16  # requests in flight
    timeout_s: float = 600.0  # per attempt
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint must be an http:// or https:// URL, got {self.url!r}")
        if self.concurrency <= 0:
            raise ValueError(f"--concurrency must be positive, got {self.concurrency}")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout_s:g}")


class Breaker:
    """The job-wide circuit breaker: whether the endpoint is up, as all workers see it.

    Closed, requests go out. `breaker_after` down signals in a row (refused, reset or dropped
    connections, timeouts, 502/503/504; any other reply in between resets the count) open it:
    no worker starts an attempt, and one probe at a time (GET /v1/models, with backoff) asks
    whether the endpoint is back; its first answer (any status but those three; a 401 or 404
    still means the server is up) closes the breaker. Replies to requests that were in flight
    when it opened do not: they were sent before the outage. Open for `retry_for` seconds: the
    endpoint is `gone`, and `halt` is set so every worker stops waiting.
    """

    def __init__(
        self, url: str, policy: RetryPolicy, probe: Callable[[], Awaitable[str | None]], halt: asyncio.Event
    ) -> None:
        self.url, self.policy, self._probe, self._halt = url, policy, probe, halt
        self._closed = asyncio.Event()
        self._closed.set()
        self._streak = 0
        self.opened_at: float | None = None
        self._down_before = 0.0  # seconds open in this run's earlier outages
        self.last_error = ""
        self.gone = False
        self._prober: asyncio.Task[None] | None = None

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
        _say(f"the endpoint {self.url} is not answering ({self.last_error}); holding new requests and "
             f"probing it for up to {self.policy.retry_for:g} s (--retry-for)")

    async def wait(self) -> bool:
        """Wait while the breaker is open; True to go on, False when the job halts."""
        if not self._closed.is_set():
            await _wait_any(self._closed, self._halt)
        return not self._halt.is_set()

    def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()

    def _close(self, opened_at: float) -> None:
        down = time.monotonic() - opened_at
        self._down_before += down
        self.opened_at, self._streak = None, 0
        self._closed.set()
        _say(f"the endpoint {self.url} answers again after {down:.1f} s; resuming")

    async def _probe_until_back(self, opened_at: float) -> None:
        deadline = opened_at + self.policy.retry_for
        for probes in itertools.count():
            # The last probe goes out at the deadline, so a server back just in time still counts.
            wait = min(self.policy.probe_delay(probes), max(0.0, deadline - time.monotonic()))
            if await _sleep_unless(self._halt, wait):
                return
            error = await self._probe()
            if error is None:
                self._close(opened_at)
                return
            self.last_error = error
            if time.monotonic() >= deadline:
                self.gone = True
                self._halt.set()
                return


@dataclass
class _Run:
    """What the workers of one `run` share."""

    client: aiohttp.ClientSession
    sink: ResultSink
    halt: asyncio.Event  # a stop signal, or the endpoint gone: every sleep and wait ends
    breaker: Breaker


class EndpointBackend:
    kind = "endpoint"

    def __init__(self, spec: EndpointSpec, *, seed: int | None = None) -> None:
        """`seed`: the retry jitter's (tests)."""
        base = spec.url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base  # request urls start with /v1
        self.api_key, self.concurrency, self.timeout = spec.api_key, spec.concurrency, spec.timeout_s
        self.retry = spec.retry
        self.model = spec.model or "as in each request"
        self._rng = random.Random(seed)
        self._retries = 0
        # The last run gave up on a dead endpoint: the next starts with one probe, and ends at once
        # if it fails (a Ray replica runs batch after batch, and each failed one again alone).
        self._gone = False

    def check(self, request: BatchRequest) -> None:
        """The server has the last word on what it supports."""

    def start(self) -> None:
        """Connections are opened per run."""

    def unreachable(self) -> str | None:
        """One probe now: None when the endpoint answers, else why not (`tokenmill choose` asks
        before a candidate's run, so a server that is down costs one probe, not --retry-for)."""
        async def probe() -> str | None:
            async with self._session(limit=1) as client:
                return await self._probe(client)

        return asyncio.run(probe())

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        self._retries = 0
        before = sink.done + sink.failed
        breaker = asyncio.run(self._run(requests, sink, stop))
        self._gone = breaker.gone
        if breaker.gone:
            raise JobFailed(
                f"the endpoint {self.base_url} has not answered for {self.retry.retry_for:g} s (--retry-for; "
                f"last error: {breaker.last_error}); the {sink.done + sink.failed - before} row(s) written this "
                "run are kept and the requests not done were left for the next run: once the server is up, "
                "re-run the same command to resume")
        return BackendStats(retries=self._retries)

    def _session(self, limit: int) -> aiohttp.ClientSession:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return aiohttp.ClientSession(
            base_url=self.base_url + "/", headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300), json_serialize=_json_text,
        )

    async def _run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> Breaker:
        halt = asyncio.Event()
        # One connection more than workers: the breaker's probe never waits for a busy pool.
        async with self._session(limit=self.concurrency + 1) as client:
            breaker = Breaker(self.base_url, self.retry, lambda: self._probe(client), halt)
            if self._gone and (error := await self._probe(client)) is not None:
                breaker.gone, breaker.last_error = True, error  # still down: one probe, not another wait
                return breaker
            run = _Run(client, sink, halt, breaker)
            workers = [asyncio.create_task(self._worker(run, requests, stop)) for _ in range(self.concurrency)]
            watcher = asyncio.create_task(_watch(stop, halt, workers))
            await asyncio.wait(workers)
            watcher.cancel()
            breaker.stop()
        for task in workers:  # a bug in a worker must not pass silently
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return breaker

    async def _worker(self, run: _Run, requests: Iterator[BatchRequest], stop: StopFlag) -> None:
        # No new request while the breaker is open: a dead endpoint holds the job, not 16 retry loops.
        while not stop.requested and await run.breaker.wait():
            request = next(requests, None)  # one thread: workers take turns without a lock
            if request is None:
                return
            await self._serve(run, request)

    async def _serve(self, run: _Run, request: BatchRequest) -> None:
        """Try until the outcome is final or the request's budget is spent; return without a row
        (not done, so a re-run does it) when the job halts."""
        started, down_before = time.monotonic(), run.breaker.down_s()
        for attempt in itertools.count(1):
            if not await run.breaker.wait():
                return
            result = await self._attempt(run.client, request)
            run.breaker.report(result)
            if result.body is not None:
                run.sink.result(request, result.body, result.request_id)
                return
            if not result.retry:
                run.sink.error(request, result.code, result.message, result.response)
                return
            delay = self.retry.delay(attempt, result.retry_after, self._rng)
            # Time the breaker was open is the outage's, not this request's: one clock for the job.
            spent = time.monotonic() - started - (run.breaker.down_s() - down_before)
            if self.retry.exhausted(attempt, spent + delay):
                break
            if await _sleep_unless(run.halt, delay):
                return
            self._retries += 1
        message = f"{result.message} (gave up after {attempt} attempt(s) in {spent:.1f} s)"
        run.sink.error(request, result.code, message, result.response)

    async def _attempt(self, client: aiohttp.ClientSession, request: BatchRequest) -> Attempt:
        try:
            async with client.post(request.url.lstrip("/"), data=orjson.dumps(request.body)) as reply:
                raw = await reply.read()
        except TimeoutError as exc:
            return Attempt(code="timeout", message=f"no reply within {self.timeout:g} s ({type(exc).__name__})",
                           retry=True, down=True)
        except aiohttp.ClientError as exc:  # refused, reset, dropped mid-reply
            return Attempt(code="connection_error", message=_describe(exc), retry=True, down=True)
        request_id = reply.headers.get("x-request-id") or new_id("req_")
        body = _json_or_none(raw)
        if 200 <= reply.status < 300:
            if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
                return Attempt(code="bad_response", message=f"HTTP {reply.status} without a completion body",
                               retry=True)
            return Attempt(body=body, request_id=request_id)
        text = raw.decode("utf-8", "replace")
        response = {"status_code": reply.status, "request_id": request_id,
                    "body": body if body is not None else text[:2000]}
        message = f"HTTP {reply.status}: {_error_message(body, text)}"
        retry_after = parse_retry_after(reply.headers.get("retry-after"))
        if reply.status == 429:
            return Attempt(code="rate_limited", message=message, retry=True, retry_after=retry_after, response=response)
        if reply.status >= 500:
            return Attempt(code="server_error", message=message, retry=True, retry_after=retry_after,
                           response=response, down=reply.status in DOWN_STATUSES)
        return Attempt(code=f"http_{reply.status}", message=message, response=response)

    async def _probe(self, client: aiohttp.ClientSession) -> str | None:
        """None when the endpoint answers at all (a 401 or 404 too: it is up), else why not."""
        timeout = aiohttp.ClientTimeout(total=min(self.timeout, self.retry.probe_timeout))
        try:
            async with client.get(PROBE_PATH.lstrip("/"), timeout=timeout) as reply:
                status = reply.status
        except Exception as exc:  # whatever keeps it from answering is a failed probe, named in the end
            return _describe(exc)
        return f"HTTP {status} from GET {PROBE_PATH}" if status in DOWN_STATUSES else None


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


async def _sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep; True if `event` was set first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def _say(text: str) -> None:
    print(f"tokenmill run: {text}", file=sys.stderr)  # above the progress bar (rich redirects stderr)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _json_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode()


def _error_message(body: Any, text: str) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
    return text.strip()[:300] or "(empty body)"
