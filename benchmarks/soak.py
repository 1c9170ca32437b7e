"""A soak of `tokenmill serve`: mixed live traffic, uploads, two Batch API batches and a kill -9 +
restart of the server in the middle, for a bounded time. It prints one report and exits 1 if any
of its checks fails:

    .venv/bin/python benchmarks/stress.py soak --minutes 10    # the figures in docs/serve.md
    .venv/bin/python benchmarks/stress.py soak --minutes 2     # a short look
    .venv/bin/python benchmarks/soak.py --minutes 2 --keep-tmp # the same; keeps the server log

From the script's start until --minutes have passed (model loads and warm-ups included), against one
`tokenmill serve` on a temporary --state-dir (stress.py's settings, and a KV cache of KV_BLOCKS),
driven by the `openai` client:

- LIVE_WORKERS clients in a closed loop, each request one of: a small completion or chat
  (SMALL_TOKENS, not streamed: the latencies reported), a streamed completion or chat read to its
  end, or a stream closed after a chunk or two (cancelled);
- an uploader: a batch input file up every UPLOAD_EVERY_S, read back byte for byte, deleted;
- two batches of BATCH_ROWS lines, one on /v1/completions made at the start, one on
  /v1/chat/completions made at the middle; then, once a batch has rows done and rows to go, the
  server is kill -9'd and restarted on the same --state-dir and port.

A request that fails while the server is down, or that was in flight at the kill, counts as failed
during the outage and is sent again once the server is back; any other failure is an error. After
the window the batches get --drain-timeout to finish. PASS needs all of:

- no error outside the outage (a wrong answer, an HTTP error, a stream without its end);
- both batches `completed`, every input custom_id exactly once across the output and error files,
  and no error row (every line is valid, so an error row is a request the server lost);
- the server's RSS at the end of each of its two lives within RSS_FACTOR x its RSS after its
  warm-up + RSS_SLACK_MB (see there why);
- the engine drained (0 running, 0 waiting) once the batches are done: no cancelled stream left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from openai.types import Batch
from stress import MODEL, CheckFailed, Server, duplicates, metrics, tail, workspace

try:
    import psutil
except ImportError:  # the /proc fallback below reads the same number
    psutil = None

LIVE_WORKERS = 6  # with the batches' lines, enough to keep 2 cores busy without a queue that only grows
SMALL_TOKENS, STREAM_TOKENS, CANCEL_TOKENS = 8, 32, 64  # a cancelled stream still has most of its 64 to go
# What each live request is, by weight: ~60 % small ones (the latency sample), the rest streams, 15 % cancelled.
KINDS = {"completion": 30, "chat": 30, "stream-completion": 13, "stream-chat": 12, "cancelled-stream": 15}
SMALL = ("completion", "chat")
BATCH_ROWS = 48
UPLOAD_EVERY_S = 5.0
UPLOAD_LINES = (20, 5000)  # alternately: a small file, and ~1.2 MB, over what Starlette keeps in memory (1 MB)
REQUEST_TIMEOUT_S = 60  # a small request takes well under a second here: 60 s is a hang, an error
KILL_WAIT_S = 60  # at the kill, how long to wait for a batch to be part-done before killing anyway
# The KV cache is committed lazily (each block zeroed at its first use) and handed out least recently
# used first, so that the prefix cache keeps freed blocks' content as long as it can: a fresh server's
# RSS grows by the whole cache over its first thousands of requests, by design. So the soak's server
# gets a cache it can fill quickly (KV_BLOCKS x 16 tokens, ~140 MB here, still twice what the soak's
# requests hold at once), and the warm-up fills it: distinct ~FILL_WORDS-token prompts, a quarter more
# tokens than the cache holds, so that every block has been used once.
KV_BLOCKS, FILL_WORDS = 384, 440
FILL_PROMPTS = math.ceil(KV_BLOCKS * 16 * 1.25 / FILL_WORDS)
MIN_SAMPLES = 20  # small live requests each life must have answered for its figures to mean something
# The RSS bound: each life's end <= RSS_FACTOR x its RSS after the warm-up + RSS_SLACK_MB. By then
# the weights, the whole KV cache and the kernels are in place; what may still grow is the allocator's
# and Python's heaps, a few MB (+8 MB over a minute here). Anything kept per request, on the other
# hand — its logits row alone is 49,152 x 4 B = 192 KB — over the ~1,000 requests of one life of a
# 10-minute run passes the ~150 MB that 10 % + 64 MB allows a ~860 MB server. The report also gives
# each life's growth per request: an upper bound on what a leak could be costing.
RSS_FACTOR, RSS_SLACK_MB = 1.10, 64
TERMINAL = ("completed", "failed", "expired", "cancelled")
FINISHED = ("stop", "length")
TOPICS = ("the sea", "a kettle", "trains", "winter", "a red door", "bread", "the moon", "a small dog")


class BadAnswer(Exception):
    """An answer that came but is wrong: no finish_reason, no tokens, a stream without its end."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise BadAnswer(what)


def prompt(n: int) -> str:
    # A different prompt per request, so the prefix cache does not turn the soak into a cache test.
    return f"Request {n}: in one short sentence, say something kind about {TOPICS[n % len(TOPICS)]}."


# ---- one request of each kind -----------------------------------------------------------------------


async def small_completion(client: openai.AsyncOpenAI, n: int) -> str:
    answer = await client.completions.create(model=MODEL, prompt=prompt(n), max_tokens=SMALL_TOKENS, seed=n)
    choice = answer.choices[0]
    expect(choice.finish_reason in FINISHED and answer.usage.completion_tokens >= 1, f"completion {answer}")
    return "answered"


async def small_chat(client: openai.AsyncOpenAI, n: int) -> str:
    answer = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt(n)}], max_tokens=SMALL_TOKENS, seed=n
    )
    choice = answer.choices[0]
    expect(choice.finish_reason in FINISHED and answer.usage.completion_tokens >= 1, f"chat {answer}")
    return "answered"


async def stream(client: openai.AsyncOpenAI, n: int, chat: bool, cancel_after: int | None = None) -> str:
    """A stream read to its last chunk, or (cancel_after) closed after that many chunks: leaving the
    `async with` closes the connection mid-body, which is how a client cancels."""
    tokens = STREAM_TOKENS if cancel_after is None else CANCEL_TOKENS
    common = {"model": MODEL, "max_tokens": tokens, "stream": True, "seed": n, "extra_body": {"ignore_eos": True}}
    if chat:
        chunks = await client.chat.completions.create(messages=[{"role": "user", "content": prompt(n)}], **common)
    else:
        chunks = await client.completions.create(prompt=prompt(n), **common)
    seen, finish = 0, None
    async with chunks:
        async for chunk in chunks:
            if chunk.choices:
                seen += 1
                finish = chunk.choices[0].finish_reason or finish
            if cancel_after is not None and seen >= cancel_after:
                return "cancelled"
    expect(finish in FINISHED, f"a stream of {seen} chunks ended without a finish_reason")
    return "answered"


async def upload(client: openai.AsyncOpenAI, n: int) -> str:
    """A batch input up, read back byte for byte, deleted (so the state dir does not grow with the soak)."""
    data = batch_input(f"up{n}", UPLOAD_LINES[n % 2], "/v1/completions")
    created = await client.files.create(file=(f"up-{n}.jsonl", data), purpose="batch")
    back = await client.files.content(created.id)
    expect(back.content == data, f"{created.id}: {len(back.content)} bytes back of {len(data)}")
    expect((await client.files.delete(created.id)).deleted, f"{created.id} not deleted")
    return "answered"


Request = Callable[[openai.AsyncOpenAI, int], Awaitable[str]]
REQUESTS: dict[str, Request] = {
    "completion": small_completion,
    "chat": small_chat,
    "stream-completion": lambda client, n: stream(client, n, chat=False),
    "stream-chat": lambda client, n: stream(client, n, chat=True),
    # Alternately a completion and a chat, closed after 1 to 3 chunks.
    "cancelled-stream": lambda client, n: stream(client, n, chat=n % 2 == 1, cancel_after=1 + n % 3),
    "upload": upload,
}


def batch_input(prefix: str, rows: int, endpoint: str) -> bytes:
    """Batch API lines with unique custom_ids; staggered lengths (8-23 tokens), so rows finish a few at
    a time and the kill lands between them rather than after a whole engine batch at once."""
    lines = []
    for i in range(rows):
        body: dict = {"model": MODEL, "max_tokens": 8 + i % 16, "temperature": 0, "ignore_eos": True}
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": prompt(i)}]
        else:
            body["prompt"] = prompt(i)
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": endpoint, "body": body}))
    return ("\n".join(lines) + "\n").encode()


# ---- the soak's state -------------------------------------------------------------------------------


class Outage:
    """Whether the server is up, and which of its lives a request began in: a failure while it is down,
    or of a request begun before the kill, is the outage's doing, not the server's."""

    def __init__(self) -> None:
        self.up = asyncio.Event()
        self.up.set()
        self.kills = 0

    def begin(self) -> None:
        self.up.clear()
        self.kills += 1

    def end(self) -> None:
        self.up.set()

    def explains(self, kills_at_start: int) -> bool:
        return not self.up.is_set() or kills_at_start != self.kills


@dataclass
class Tally:
    sent: Counter[str] = field(default_factory=Counter)  # attempts, the ones sent again included
    answered: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    outage: Counter[str] = field(default_factory=Counter)  # attempts lost to the outage
    recovered: int = 0  # requests answered after an attempt lost to the outage
    errors: list[str] = field(default_factory=list)
    done_by_life: Counter[int] = field(default_factory=Counter)  # requests done (uploads too), by server life
    latency: dict[str, list[float]] = field(default_factory=lambda: {"before": [], "after": []})


@dataclass
class Soak:
    client: openai.AsyncOpenAI
    server: Server
    deadline: float
    outage: Outage = field(default_factory=Outage)
    tally: Tally = field(default_factory=Tally)
    rss: list[tuple[int, int]] = field(default_factory=list)  # (kills before it, bytes), every few seconds
    numbers: int = 0

    def next_number(self) -> int:
        self.numbers += 1
        return self.numbers

    def left(self) -> float:
        return self.deadline - time.monotonic()


async def attempt(soak: Soak, kind: str, n: int) -> str:
    """Send one request: "done" (answered or cancelled as meant), "error", or "lost" to the outage."""
    kills, tally = soak.outage.kills, soak.tally
    tally.sent[kind] += 1
    start = time.monotonic()
    try:
        outcome = await REQUESTS[kind](soak.client, n)
    except (openai.APIError, httpx.HTTPError, BadAnswer) as exc:
        if soak.outage.explains(kills):
            tally.outage[kind] += 1
            return "lost"
        tally.errors.append(f"{kind} #{n}: {type(exc).__name__}: {str(exc)[:300]}")
        return "error"
    tally.done_by_life[kills] += 1
    if outcome == "cancelled":
        tally.cancelled += 1
    else:
        tally.answered[kind] += 1
    if kind in SMALL:
        tally.latency["before" if kills == 0 else "after"].append(time.monotonic() - start)
    return "done"


async def worker(soak: Soak, pick: Callable[[], str], pause_s: float = 0.0) -> None:
    """Requests one after another until the deadline; one lost to the outage waits for the server to
    be back and goes again, while the window lasts."""
    while soak.left() > 0:
        kind, n = pick(), soak.next_number()
        outcome = await attempt(soak, kind, n)
        while outcome == "lost":
            await soak.outage.up.wait()
            if soak.left() <= 0:
                break
            outcome = await attempt(soak, kind, n)
            soak.tally.recovered += outcome == "done"
        if pause_s:
            await asyncio.sleep(min(pause_s, max(soak.left(), 0)))


def rss_bytes(pid: int) -> int:
    if psutil is not None:
        return psutil.Process(pid).memory_info().rss
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def sample_rss(soak: Soak) -> int:
    assert soak.server.proc is not None
    value = rss_bytes(soak.server.proc.pid)
    soak.rss.append((soak.outage.kills, value))
    return value


async def rss_sampler(soak: Soak) -> None:
    """Every few seconds while the server is up: the peak, and a record to see a trend in."""
    while soak.left() > 0:
        await asyncio.sleep(5)
        if soak.outage.up.is_set():
            sample_rss(soak)


async def warm_up(soak: Soak) -> int:
    """One of every kind at once (the kernels built, the pools filled), then the KV cache filled (see
    KV_BLOCKS), so that the RSS taken after it is the server's working size, not its size before its
    first requests. Returns the bytes the fill added."""
    assert soak.server.proc is not None
    pid = soak.server.proc.pid
    try:
        await asyncio.gather(*(request(soak.client, -1 - i) for i, request in enumerate(REQUESTS.values())))
        before = rss_bytes(pid)
        await asyncio.gather(*(fill_prompt(soak.client, soak.next_number()) for _ in range(FILL_PROMPTS)))
    except (openai.APIError, httpx.HTTPError, BadAnswer) as exc:
        raise CheckFailed(f"the warm-up failed: {type(exc).__name__}: {exc}") from exc
    return rss_bytes(pid) - before


async def fill_prompt(client: openai.AsyncOpenAI, n: int) -> None:
    # The number first: no two share a first block, so none is a prefix-cache hit and each takes new blocks.
    await client.completions.create(model=MODEL, prompt=f"{n} " + "word " * FILL_WORDS, max_tokens=1)


# ---- batches ----------------------------------------------------------------------------------------


@dataclass
class BatchPlan:
    endpoint: str
    ids: list[str]
    batch_id: str = ""
    at_kill: str = "-"  # its status and progress when the server was killed
    final: Batch | None = None


async def create_batch(client: openai.AsyncOpenAI, prefix: str, endpoint: str) -> BatchPlan:
    data = batch_input(prefix, BATCH_ROWS, endpoint)
    plan = BatchPlan(endpoint, [json.loads(line)["custom_id"] for line in data.splitlines()])
    created = await client.files.create(file=(f"{prefix}.jsonl", data), purpose="batch")
    batch = await client.batches.create(input_file_id=created.id, endpoint=endpoint, completion_window="24h")
    plan.batch_id = batch.id
    return plan


def progress(batch: Batch) -> str:
    counts = batch.request_counts
    return f"{batch.status} {counts.completed + counts.failed}/{counts.total}" if counts else batch.status


async def wait_for_a_part_done_batch(client: openai.AsyncOpenAI, plans: list[BatchPlan]) -> None:
    """Until some batch has rows done and rows to go (the kill then lands mid-batch), or KILL_WAIT_S;
    notes each batch's state for the report."""
    until = time.monotonic() + KILL_WAIT_S
    while True:
        batches = [await client.batches.retrieve(plan.batch_id) for plan in plans]
        for plan, batch in zip(plans, batches, strict=True):
            plan.at_kill = progress(batch)
        if any(b.status == "in_progress" and 0 < b.request_counts.completed < b.request_counts.total for b in batches):
            return
        if time.monotonic() > until:
            return
        await asyncio.sleep(0.25)


async def drain(client: openai.AsyncOpenAI, plans: list[BatchPlan], timeout_s: float) -> float:
    """Poll until every batch has ended (or the timeout); returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        for plan in plans:
            plan.final = await client.batches.retrieve(plan.batch_id)
        if all(plan.final.status in TERMINAL for plan in plans):
            break
        await asyncio.sleep(1)
    return time.monotonic() - start


async def file_rows(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    text = (await client.files.content(file_id)).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def check_batch(client: openai.AsyncOpenAI, plan: BatchPlan) -> tuple[str, list[str]]:
    """(a line for the report, problems): completed, each custom_id once across output and errors."""
    batch = plan.final
    assert batch is not None
    output, errors = await file_rows(client, batch.output_file_id), await file_rows(client, batch.error_file_id)
    ids = [row["custom_id"] for row in output + errors]
    missing, strays, twice = set(plan.ids) - set(ids), set(ids) - set(plan.ids), duplicates(ids)
    not_200 = [row["custom_id"] for row in output if row["response"]["status_code"] != 200]
    problems = []
    if batch.status != "completed":
        problems.append(f"{plan.batch_id} {progress(batch)}, not completed")
    if missing or strays or twice:
        problems.append(
            f"{plan.batch_id}: {len(missing)} custom_ids missing {sorted(missing)[:3]}, {len(twice)} twice "
            f"{twice[:3]}, {len(strays)} strays {sorted(strays)[:3]}"
        )
    if errors or not_200:
        codes = Counter(row["error"]["code"] for row in errors)
        problems.append(f"{plan.batch_id}: error rows {dict(codes)}, outputs not 200: {not_200[:3]}")
    once = not (missing or strays or twice)
    line = (
        f"{plan.batch_id} {plan.endpoint}: {progress(batch)} (at the kill: {plan.at_kill}); "
        f"output {len(output)} + error {len(errors)} rows, every custom_id exactly once: {'yes' if once else 'NO'}"
    )
    return line, problems


# ---- the run ----------------------------------------------------------------------------------------


@dataclass
class Timeline:
    load_s: float = 0.0
    setup_s: float = 0.0  # the first load and warm-up
    kill_at_s: float = 0.0  # since the script's start
    outage_s: float = 0.0  # the kill to the restarted server warmed up
    restart_load_s: float = 0.0
    window_s: float = 0.0
    drain_s: float = 0.0
    rss_marks: dict[str, int] = field(default_factory=dict)  # start, before kill, after restart, end
    fills: list[int] = field(default_factory=list)  # the bytes each life's KV fill added


async def kill_and_restart(soak: Soak, marks: Timeline, started: float) -> None:
    marks.rss_marks["before kill"] = sample_rss(soak)
    soak.outage.begin()
    killed = time.monotonic()
    marks.kill_at_s = killed - started
    soak.server.kill()
    # On a thread: the workers keep running meanwhile, each finding the server gone.
    marks.restart_load_s = await asyncio.to_thread(soak.server.start)
    marks.fills.append(await warm_up(soak))
    marks.rss_marks["after restart"] = sample_rss(soak)
    marks.outage_s = time.monotonic() - killed
    soak.outage.end()


async def engine_drained(server: Server) -> bool:
    """Running and waiting back to 0 within 10 s once the batches are done: no request left behind."""
    names = ("tokenmill_num_requests_running", "tokenmill_num_requests_waiting")
    with httpx.Client(trust_env=False, timeout=10) as http:
        for _ in range(20):
            values = await asyncio.to_thread(metrics, http, server.url)
            if all(values.get(name, -1) == 0 for name in names):
                return True
            await asyncio.sleep(0.5)
    return False


def start_traffic(soak: Soak, seed: int) -> list[asyncio.Task]:
    """The live workers, the uploader and the RSS sampler; each ends by itself at the deadline."""
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    tasks = [asyncio.create_task(worker(soak, lambda: rng.choices(kinds, weights)[0])) for _ in range(LIVE_WORKERS)]
    tasks.append(asyncio.create_task(worker(soak, lambda: "upload", UPLOAD_EVERY_S)))
    tasks.append(asyncio.create_task(rss_sampler(soak)))
    return tasks


async def run_soak(server: Server, minutes: float, drain_timeout_s: float, seed: int) -> tuple[list[str], bool]:
    """The whole soak; returns the report's lines and whether it passed."""
    started = time.monotonic()
    marks = Timeline()
    marks.load_s = await asyncio.to_thread(server.start)
    http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=64))
    client = openai.AsyncOpenAI(
        base_url=server.v1, api_key="soak", max_retries=0, timeout=REQUEST_TIMEOUT_S, http_client=http
    )
    soak = Soak(client, server, deadline=started + minutes * 60)
    marks.fills.append(await warm_up(soak))
    marks.rss_marks["start"] = sample_rss(soak)
    marks.setup_s = time.monotonic() - started
    plans = [await create_batch(client, "completions", "/v1/completions")]
    # The kill comes where the two lives get the same time of traffic, taking the restart to cost
    # what the first load and warm-up did: on a busy machine those are a good part of a short window.
    kill_at = started + marks.setup_s + max(0.0, minutes * 60 - 2 * marks.setup_s) / 2
    tasks = start_traffic(soak, seed)
    try:
        await asyncio.sleep(max(0.0, kill_at - time.monotonic()))
        plans.append(await create_batch(client, "chat", "/v1/chat/completions"))
        await wait_for_a_part_done_batch(client, plans)
        await kill_and_restart(soak, marks, started)
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    marks.rss_marks["end"] = sample_rss(soak)
    marks.window_s = time.monotonic() - started
    marks.drain_s = await drain(client, plans, drain_timeout_s)
    checked = [await check_batch(client, plan) for plan in plans]
    drained = await engine_drained(server)
    await client.close()
    return report(soak, marks, checked, drained, minutes)


# ---- the report -------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: with fewer than 100 values, p99 is the slowest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_line(values: list[float]) -> str:
    if not values:
        return "no samples"
    return f"p50 {percentile(values, 0.5):.2f} s, p99 {percentile(values, 0.99):.2f} s (n={len(values)})"


def rss_bound(start: int) -> int:
    return int(start * RSS_FACTOR + RSS_SLACK_MB * 2**20)


def mb(value: int) -> str:
    return f"{value / 2**20:.0f} MB"


def rss_lines(soak: Soak, marks: Timeline) -> tuple[list[str], list[str]]:
    """Each life of the server against its own start: the restarted one is a new process, so its
    start after the restart's warm-up is what its end is measured against."""
    lines, problems = [], []
    r = marks.rss_marks
    for life, start, end in ((1, "start", "before kill"), (2, "after restart", "end")):
        samples = [value for kills, value in soak.rss if kills == life - 1]
        ok = r[end] <= rss_bound(r[start])
        requests = soak.tally.done_by_life[life - 1]
        per_request = (r[end] - r[start]) / max(requests, 1) / 1024
        lines.append(
            f"  life {life}: {mb(r[start])} after warm-up (its KV fill +{mb(marks.fills[life - 1])}) -> "
            f"{mb(r[end])} at its end, {per_request:+.0f} KB per request over its {requests} "
            f"(peak {mb(max(samples, default=r[end]))}); bound {mb(rss_bound(r[start]))}: {'ok' if ok else 'EXCEEDED'}"
        )
        # Every sixth 5-s sample: a trend to read over a 10-minute run, not a wall of numbers.
        lines.append(f"    every 30 s: {' '.join(f'{v / 2**20:.0f}' for v in samples[::6])} MB")
        if not ok:
            problems.append(f"RSS of life {life} {mb(r[end])} > bound {mb(rss_bound(r[start]))}")
    return lines, problems


def traffic_lines(soak: Soak, marks: Timeline, minutes: float) -> list[str]:
    t = soak.tally
    live = [kind for kind in t.sent if kind != "upload"]
    sent, answered = sum(t.sent[k] for k in live), sum(t.answered[k] for k in live)
    lost = sum(t.outage[k] for k in live)
    # A cancelled stream is answered as far as it was read: it counts in its kind's answered figure.
    by_kind = ", ".join(
        f"{k} {t.answered[k] + t.cancelled * (k == 'cancelled-stream')}/{t.sent[k]}" for k in [*KINDS, "upload"]
    )
    before, after = latency_line(t.latency["before"]), latency_line(t.latency["after"])
    return [
        f"soak: {minutes:g} min window: {marks.window_s:.0f} s, of which the first load {marks.load_s:.1f} s and "
        f"warm-up {marks.setup_s - marks.load_s:.1f} s; then the batches' drain {marks.drain_s:.1f} s",
        f"kill -9 at {marks.kill_at_s:.0f} s; restarted (load {marks.restart_load_s:.1f} s) and warmed up "
        f"{marks.outage_s:.1f} s after the kill",
        f"live requests: {sent} sent, {answered} answered, {t.cancelled} cancelled mid-stream (as meant), "
        f"{lost} failed during the outage; uploads {t.answered['upload']}/{t.sent['upload']} "
        f"(up, read back, deleted; {t.outage['upload']} lost to the outage); "
        f"{t.recovered} lost requests answered when sent again; {len(t.errors)} errors",
        f"  by kind (done/sent, retries included): {by_kind}",
        f"small live requests ({SMALL_TOKENS} tokens, not streamed): before the restart {before}; after {after}",
    ]


def report(
    soak: Soak, marks: Timeline, checked: list[tuple[str, list[str]]], drained: bool, minutes: float
) -> tuple[list[str], bool]:
    errors, rss = soak.tally.errors, marks.rss_marks
    lines = traffic_lines(soak, marks, minutes)
    lines += [f"batch {line}" for line, _ in checked]
    lines.append(
        f"RSS: start {mb(rss['start'])} -> end {mb(rss['end'])}; bound: each life's end <= {RSS_FACTOR:g} x "
        f"its start + {RSS_SLACK_MB} MB"
    )
    rss_detail, problems = rss_lines(soak, marks)
    lines += rss_detail
    lines.append(f"engine drained after the batches (0 running, 0 waiting): {'yes' if drained else 'NO'}")
    log = soak.server.log
    tracebacks = log.read_text(errors="replace").count("Traceback") if log.exists() else 0
    lines.append(f"server log: {tracebacks} tracebacks" + (f", the last lines:\n{tail(log, 20)}" if tracebacks else ""))

    if errors:
        problems.insert(0, f"{len(errors)} errors outside the outage: {errors[:3]}")
    problems += [problem for _, batch_problems in checked for problem in batch_problems]
    if not drained:
        problems.append("the engine still had requests running or waiting 10 s after the batches ended")
    # A soak that was mostly model loads (a busy machine, a short window) has tested too little to pass.
    thin = [phase for phase, values in soak.tally.latency.items() if len(values) < MIN_SAMPLES]
    if thin:
        problems.append(
            f"too little traffic {' and '.join(thin)} the restart (under {MIN_SAMPLES} small requests answered): "
            "the window went on loads and warm-ups; give it more --minutes, or a quieter machine"
        )
    lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    return lines, not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stress.py soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="the traffic window, first load included")
    parser.add_argument("--drain-timeout", type=float, default=300.0, help="seconds for the batches after it")
    parser.add_argument("--seed", type=int, default=0, help="the mix of live requests")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (server log, state dir)")
    args = parser.parse_args(argv)
    if args.minutes < 1:
        parser.error("--minutes must be at least 1: the first model load alone takes ~20 s")
    # SIGTERM to this script becomes an exception, so the finally block kills the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with workspace("tokenmill-soak-", args.keep_tmp) as (children, tmp):
        server = Server(children, tmp, "--num-kv-blocks", str(KV_BLOCKS))
        try:
            lines, passed = asyncio.run(run_soak(server, args.minutes, args.drain_timeout, args.seed))
        except CheckFailed as exc:
            lines, passed = [f"FAIL: {exc}"], False
        except Exception as exc:  # a bug here or a server that misbehaves in a new way: a FAIL with the reason
            traceback.print_exc()
            lines, passed = [f"FAIL: crashed: {type(exc).__name__}: {exc}\n{tail(server.log)}"], False
    print("\n".join(lines), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
