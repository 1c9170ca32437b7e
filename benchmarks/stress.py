"""Stress checks against real `tokenmill run` / `tokenmill serve` processes on this machine.

Each check re-measures a figure an earlier stress run reported and prints one line: PASS or FAIL,
the figures it measured, and a note when something needs explaining. The script exits 1 if any
check fails, so "the stress figures still hold" after a change is one command:

    .venv/bin/python benchmarks/stress.py --quick          # ~4 min on 2 idle CPU cores
    .venv/bin/python benchmarks/stress.py                  # full sizes, ~5-6 min
    .venv/bin/python benchmarks/stress.py --only kill      # one check (names below)
    .venv/bin/python benchmarks/stress.py --quick --keep-tmp   # keep logs and outputs to look at
    .venv/bin/python benchmarks/stress.py soak --minutes 10    # the soak: benchmarks/soak.py, its own options

Checks (full size; --quick shrinks the counts, not the conditions: kill 80 lines and 2 SIGKILLs,
streams 60 / 30, batch-restart 60 lines killed at ~20; the other three are the same in both):

  kill              a 150-line job + 10 bad lines, SIGKILLed 5 times, then SIGINT, SIGTERM, run to the end:
                    exactly one row per line, nothing else
  streams           200 concurrent streams, 100 closed after a chunk or two: the engine drains to
                    0 running / 0 waiting / 0 KV within seconds, no 5xx, the other 100 end with [DONE]
  traversal         28 path-traversal file ids on the Files API: every answer 404 (or 400), never 200
                    or 5xx; the real file still readable; 6 look-alikes of its id ("x/<id>", "<id>.json", …)
                    as a batch's input_file_id: each a 400, no batch made on one
  batch-restart     a 150-line Batch API batch, the server kill -9'd at ~50 done and restarted on the same
                    --state-dir: completed 150/150, one output row per custom_id
  big-request       a 20 MB body (413) and an 8 MB prompt (400 context_length_exceeded) beside a stream:
                    answered promptly, /health stays under 100 ms, the stream keeps flowing
  fair-tokenize     four ~1.3 MB prompts being tokenized (--max-model-len 8192, so they are tokenized, not
                    refused by length), then a 2-token request: answered within 0.5 s (it took 4.65 s when
                    one pool of two threads served them first come, first served)
  endpoint-restart  `tokenmill run --endpoint` against `tokenmill serve`, the server kill -9'd 5 s in and
                    back ~10 s later: the job ends with every row done once, exit 0 (the circuit
                    breaker and the --retry-for budget; before them, 6 attempts gave up in ~8-16 s)

Every model load takes ~12-20 s here, which is most of the time (kill alone loads 5 or 8 times:
~65 s quick, ~110 s full). On a busy machine everything is slower: the waits for loads and jobs
are generous, and only the measured figures decide PASS/FAIL. Every child runs in its own process
group and is killed (SIGKILL to the group) when its check ends, pass, fail or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "stress"  # --served-model-name, so request bodies do not depend on the default model's file name
# Small enough for 2 CPU cores; the same shape as the tests' server (tests/serve/conftest.py).
SERVE_SETTINGS = ("--max-model-len", "512", "--max-num-seqs", "32")
LOAD_TIMEOUT_S = 240  # a model load is ~17 s on an idle 2-core machine; a busy one can take several times that


@dataclass
class Result:
    name: str
    passed: bool
    figures: str
    note: str = ""
    seconds: float = 0.0


class CheckFailed(Exception):
    """The setup of a check went wrong (a server that never came up, a job that ended too early):
    the check fails with this message instead of measuring something meaningless."""


# ---- processes --------------------------------------------------------------------------------------


class Children:
    """Every process a check starts, so that all of them die when the check ends, whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path | None = None, **kwargs) -> subprocess.Popen:
        out = log.open("ab") if log else subprocess.DEVNULL
        try:
            # Own session: a Ctrl-C on the terminal reaches only this script, which then kills the
            # children itself; and the checks can signal one child's whole group by its pid.
            proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), start_new_session=True,
                                    stdout=kwargs.pop("stdout", out), stderr=kwargs.pop("stderr", subprocess.STDOUT),
                                    **kwargs)
        finally:
            if log:
                out.close()
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        self.procs.clear()



@contextlib.contextmanager
def workspace(prefix: str, keep: bool) -> Iterator[tuple[Children, Path]]:
    """The run's children and temp dir: the children killed when it ends, however it ends, and the
    dir removed (or kept, and named, with --keep-tmp)."""
    children, tmp = Children(), Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield children, tmp
    finally:
        children.kill_all()
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost")
    # A key in the environment would make the server demand it (and the job send it): keep the
    # checks about what they test, not about auth.
    for name in ("TOKENMILL_API_KEY", "OPENAI_API_KEY"):
        env.pop(name, None)
    return env


def tokenmill(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill", *args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_flag(command: str, flag: str) -> bool:
    """Whether `tokenmill COMMAND --help` lists FLAG: features still being written are reported, not crashed on."""
    out = subprocess.run(tokenmill(command, "--help"), cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=120)
    return flag in out.stdout


def tail(path: Path, lines: int = 15) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Server:
    """A `tokenmill serve` child on a fixed free port; start() again after kill() is a restart."""

    def __init__(self, children: Children, workdir: Path, *extra: str) -> None:
        self.children, self.port, self.extra = children, free_port(), extra
        self.state_dir, self.log = workdir / "state", workdir / "serve.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def start(self) -> float:
        """Start and wait for /health; returns the seconds it took."""
        cmd = tokenmill("serve", "--port", str(self.port), "--state-dir", str(self.state_dir),
                        "--served-model-name", MODEL, "--log-level", "warning", *SERVE_SETTINGS, *self.extra)
        started = time.monotonic()
        self.proc = self.children.start(cmd, self.log)
        with httpx.Client(trust_env=False, timeout=2) as client:
            while time.monotonic() - started < LOAD_TIMEOUT_S:
                if self.proc.poll() is not None:
                    raise CheckFailed(f"tokenmill serve exited with {self.proc.returncode}:\n{tail(self.log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - started
                time.sleep(0.1)
        raise CheckFailed(f"tokenmill serve not healthy within {LOAD_TIMEOUT_S} s:\n{tail(self.log)}")

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


# ---- small helpers ----------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """Every row of a JSONL output file; a line that is not JSON is itself a finding, so it raises."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll until true; returns the seconds waited, raises CheckFailed after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise CheckFailed(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)
    return time.monotonic() - start


def duplicates(ids: list[str]) -> list[str]:
    return [k for k, n in Counter(ids).items() if n > 1]


def completion_line(custom_id: str, prompt: str, max_tokens: int | None = None, **body) -> str:
    body = {"prompt": prompt, **body}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def metrics(client: httpx.Client, url: str) -> dict[str, float]:
    """Prometheus text → {name (with labels): value}."""
    out = {}
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# ---- the checks -------------------------------------------------------------------------------------


@dataclass
class Context:
    quick: bool
    tmp: Path
    children: Children

    def workdir(self, name: str) -> Path:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def check_kill(ctx: Context) -> Result:
    """Exactly-once under interruptions: the results and errors files are the job's checkpoint, so
    every kill, Ctrl-C and SIGTERM must leave rows a re-run neither repeats nor loses."""
    good = 80 if ctx.quick else 150
    kill_delays = [0.0, 0.5] if ctx.quick else [0.0, 0.2, 0.4, 0.7, 1.0]  # after this run's first new row
    work = ctx.workdir("kill")
    # Ten bad lines of four kinds, spread through the file; validation must record each exactly once
    # however many runs see it.
    bad = [
        '{"custom_id": "bad-json-1", "method": "POST",',
        '{"custom_id": "bad-json-2" "method": "POST"}',
        "this line is not JSON at all",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "no custom_id"}}),
        json.dumps({"custom_id": "bad-nobody", "method": "POST", "url": "/v1/completions"}),
        json.dumps({"custom_id": "bad-noprompt", "method": "POST", "url": "/v1/completions", "body": {}}),
        completion_line("bad-str-1", "x", max_tokens="5"),
        completion_line("bad-str-2", "y", max_tokens="5"),
        json.dumps({"custom_id": "bad-url-1", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        json.dumps({"custom_id": "bad-url-2", "method": "POST", "url": "/v2/completions", "body": {"prompt": "x"}}),
    ]
    lines, good_ids, bad_numbers = [], [], []
    step = good // len(bad)
    for i in range(good):
        if i % step == step // 2 and len(bad_numbers) < len(bad):
            lines.append(bad[len(bad_numbers)])
            bad_numbers.append(len(lines))  # 1-based line numbers
        lines.append(completion_line(f"g-{i}", f"Review {i}: the kettle boils fast and the lid fits."))
        good_ids.append(f"g-{i}")
    path = work / "input.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out = work / "out"
    results, errors = out / "results.jsonl", out / "errors.jsonl"
    # --max-num-seqs 8 slows the job down so that seven interruptions all land mid-run.
    cmd = tokenmill("run", str(path), "-o", str(out), "--input-format", "batch", "--max-tokens", "4",
                    "--temperature", "0", "--max-num-seqs", "8", "--max-model-len", "512", "--no-progress")
    log = work / "run.log"

    def interrupted_run(sig: signal.Signals, delay: float) -> int:
        before = count_lines(results)
        proc = ctx.children.start(cmd, log)
        wait_until(lambda: count_lines(results) > before or proc.poll() is not None, LOAD_TIMEOUT_S,
                   "a first result in this run")
        time.sleep(delay)
        if proc.poll() is not None:
            raise CheckFailed(f"run {runs + 1} ended (exit {proc.returncode}) before its {sig.name}: "
                              f"the job is too short for the interruptions\n{tail(log)}")
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
        print(f"    kill: run {runs + 1}: {sig.name} {delay:.2f} s after the first new row -> exit {code}, "
              f"rows {before} -> {count_lines(results)}", file=sys.stderr)
        return code

    runs, codes = 0, []
    for delay in kill_delays:
        codes.append(interrupted_run(signal.SIGKILL, delay))
        runs += 1
    for sig in (signal.SIGINT, signal.SIGTERM):  # a graceful stop: the running batch is finished and written
        codes.append(interrupted_run(sig, 0.3))
        runs += 1
    final = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    runs += 1

    result_ids = [r["custom_id"] for r in read_rows(results)]
    error_rows = read_rows(errors)
    invalid_lines = [r.get("line") for r in error_rows if r["error"]["code"] == "invalid_input"]
    others = [r for r in error_rows if r["error"]["code"] != "invalid_input"]
    expected_codes = [-signal.SIGKILL] * len(kill_delays) + [130, 130]
    problems = []
    if codes != expected_codes:
        problems.append(f"interrupted exits {codes}, expected {expected_codes}")
    if final.returncode != 1:  # 1: finished, some lines (the bad ones) failed
        problems.append(f"final exit {final.returncode}, expected 1: {final.stderr[-400:]}")
    if sorted(result_ids) != sorted(good_ids):
        missing = sorted(set(good_ids) - set(result_ids))
        problems.append(f"results: {len(missing)} missing {missing[:5]}, duplicates {duplicates(result_ids)[:5]}, "
                        f"strays {sorted(set(result_ids) - set(good_ids))[:5]}")
    if sorted(invalid_lines) != bad_numbers:
        problems.append(f"invalid_input rows for lines {sorted(invalid_lines)}, expected {bad_numbers}")
    if others:
        problems.append(f"{len(others)} other error rows: {[r['error']['code'] for r in others][:5]}")
    figures = (f"runs={runs} ({len(kill_delays)}xSIGKILL, SIGINT, SIGTERM, final exit {final.returncode}) "
               f"results={len(result_ids)} unique={len(set(result_ids))}/{len(good_ids)} "
               f"invalid_input={len(invalid_lines)}/{len(bad)} other_errors={len(others)}")
    return Result("kill", not problems, figures, "; ".join(problems))


def check_streams(ctx: Context) -> Result:
    """Disconnects free the engine: a closed stream is aborted, so once the survivors finish the
    scheduler is empty and the KV cache back to 0; nothing answers 5xx under the churn."""
    total, cancel = (60, 30) if ctx.quick else (200, 100)
    server = Server(ctx.children, ctx.workdir("streams"))
    server.start()

    async def one(client: httpx.AsyncClient, i: int) -> str:
        cancelled = i < cancel
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time in a small town", "max_tokens": 16,
                "ignore_eos": True, "stream": True}
        try:
            async with client.stream("POST", f"{server.v1}/completions", json=body) as response:
                if response.status_code != 200:
                    return f"http_{response.status_code}"
                chunks = 0
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        return "done" if not cancelled else "done_before_cancel"
                    if line.startswith("data: {"):
                        chunks += 1
                        if cancelled and chunks >= 1 + i % 2:
                            return "cancelled"  # leaving the block mid-body closes the connection
                return "ended_without_done"
        except httpx.HTTPError as exc:
            return f"client_error:{type(exc).__name__}"

    async def all_streams() -> list[str]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(trust_env=False, timeout=300, limits=limits) as client:
            # Interleave cancelled and kept streams in start order, so both kinds share the batch.
            order = [i for pair in zip(range(cancel), range(cancel, total), strict=False) for i in pair]
            paired = set(order)
            order += [i for i in range(total) if i not in paired]
            return await asyncio.gather(*(one(client, i) for i in order))

    with httpx.Client(trust_env=False, timeout=10) as client:
        aborts_before = metrics(client, server.url).get('tokenmill_requests_finished_total{finish_reason="abort"}', 0)
        started = time.monotonic()
        outcomes = Counter(asyncio.run(all_streams()))
        streams_s = time.monotonic() - started
        last: dict[str, float] = {}

        def drained() -> bool:
            last.update(metrics(client, server.url))
            return all(last.get(name, -1) == 0 for name in (
                "tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_ratio"))

        try:
            settle_s = wait_until(drained, 5.0, "metrics back to 0", interval=0.1)
        except CheckFailed:
            settle_s = None
        aborts = last.get('tokenmill_requests_finished_total{finish_reason="abort"}', 0) - aborts_before

    server_errors = sum(n for k, n in outcomes.items() if k.startswith("http_5"))
    problems = []
    if outcomes["done"] != total - cancel:
        problems.append(f"{outcomes['done']}/{total - cancel} kept streams ended with [DONE]")
    if outcomes["cancelled"] != cancel:
        problems.append(f"{outcomes['cancelled']}/{cancel} streams cancelled mid-stream")
    if server_errors:
        problems.append(f"{server_errors} 5xx")
    # Without aborts the closed streams would still run out their 16 tokens and the gauges would
    # reach 0 all the same, so the abort counter is what shows the disconnects were seen. A few may
    # legitimately finish before their disconnect is noticed (~0.5 s), hence 90 %, not all.
    if aborts < 0.9 * cancel:
        problems.append(f"only {aborts:.0f} of {cancel} closed streams counted as aborted")
    if settle_s is None:
        problems.append("metrics not back to 0 within 5 s: " + ", ".join(
            f"{k.removeprefix('tokenmill_')}={last.get(k)}" for k in (
                "tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_ratio")))
    figures = (f"streams={total} cancelled={outcomes['cancelled']} done={outcomes['done']} "
               f"5xx={server_errors} in {streams_s:.1f} s; aborts counted={aborts:.0f}; "
               f"running/waiting/kv=0 after {'-' if settle_s is None else f'{settle_s:.2f} s'}")
    odd = {k: n for k, n in outcomes.items() if k not in ("done", "cancelled")}
    if odd:
        problems.append(f"other outcomes {odd}")
    return Result("streams", not problems, figures, "; ".join(problems))


def traversal_ids(real: str) -> list[tuple[str, str]]:
    """28 file ids, inserted into the path *as written* (the request target is sent raw, so the
    client neither normalises `..` nor re-encodes anything)."""
    return [
        ("dot-dot", "../../etc/passwd"),
        ("dot-dot deep", "../../../../../../../../etc/passwd"),
        ("encoded /", "..%2f..%2f..%2fetc%2fpasswd"),
        ("encoded dots and /", "%2e%2e%2f%2e%2e%2fetc%2fpasswd"),
        ("upper-case encoding", "%2E%2E%2F%2E%2E%2Fetc%2Fpasswd"),
        ("double-encoded", "%252e%252e%252f%252e%252e%252fetc%252fpasswd"),
        ("double-encoded dots", "%252e%252e"),
        ("encoded ..", "%2e%2e"),
        ("literal ..", ".."),
        ("absolute", "/etc/passwd"),
        ("absolute encoded", "%2Fetc%2Fpasswd"),
        ("backslashes encoded", "..%5c..%5cetc%5cpasswd"),
        ("dots + backslash encoded", "%2e%2e%5c%2e%2e%5cetc%5cpasswd"),
        ("windows drive", "C:%5cWindows%5cwin.ini"),
        ("null byte", "passwd%00"),
        ("real id + null byte", f"{real}%00"),
        ("real id + null + .json", f"{real}%00.json"),
        ("real id + /../", f"{real}/../{real}"),
        ("real id + encoded /../", f"{real}%2f..%2f..%2fbatches"),
        ("up to the real meta file", f"..%2ffiles%2f{real}.json"),
        ("real id + .json", f"{real}.json"),
        ("overlong UTF-8 dots", "%c0%ae%c0%ae%c0%afetc%c0%afpasswd"),
        ("full-width dots", "%ef%bc%8e%ef%bc%8e%ef%bc%8fetc%ef%bc%8fpasswd"),
        ("semicolon", "..;/..;/etc/passwd"),
        ("home", "~%2f.ssh%2fid_rsa"),
        ("file: url", "file:%2f%2f%2fetc%2fpasswd"),
        ("proc self", "..%2f..%2fproc%2fself%2fenviron"),
        ("overlong id (300 chars)", "a" * 300),
    ]


def check_traversal(ctx: Context) -> Result:
    """A file id is never a path: nothing outside the state dir (or another file's metadata) is
    reachable, and odd ids are a clean 404/400, never a crash."""
    server = Server(ctx.children, ctx.workdir("traversal"))
    server.start()
    content = b'{"custom_id": "r-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n'
    with httpx.Client(trust_env=False, timeout=30) as client:
        upload = client.post(f"{server.v1}/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
        upload.raise_for_status()
        real = upload.json()["id"]
        # Is there a DELETE route at all? 405 on an unknown id says no.
        has_delete = client.delete(f"{server.v1}/files/file-doesnotexist").status_code != 405

    routes = [("GET", "/v1/files/{id}"), ("GET", "/v1/files/{id}/content")]
    if has_delete:
        routes.append(("DELETE", "/v1/files/{id}"))
    answers: Counter[int | str] = Counter()
    bad: list[str] = []
    variants = traversal_ids(real)
    for name, file_id in variants:
        for method, route in routes:
            target = route.replace("{id}", file_id)
            # A fresh connection each time: a 500 makes uvicorn close the connection, and a pooled
            # one would then fail the *next* probe.
            with httpx.Client(trust_env=False, timeout=30, follow_redirects=True) as client:
                request = client.build_request(method, f"{server.url}/", extensions={"target": target.encode()})
                try:
                    status: int | str = client.send(request).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
            answers[status] += 1
            if status not in (400, 404):
                bad.append(f"{method} {target[:60]} ({name}) -> {status}")

    with httpx.Client(trust_env=False, timeout=30) as client:
        meta = client.get(f"{server.v1}/files/{real}")
        body = client.get(f"{server.v1}/files/{real}/content")
        batch_answers = look_alike_batches(client, server, real)
    readable = meta.status_code == 200 and body.status_code == 200 and body.content == content
    problems = bad[:6] + ([f"{len(bad) - 6} more"] if len(bad) > 6 else [])
    if not readable:
        problems.append(f"the real file is not readable: {meta.status_code}/{body.status_code}")
    problems += [f"input_file_id {spelling!r} -> {status}" for spelling, status in batch_answers.items()
                 if status not in (400, 404)]
    figures = (f"variants={len(variants)} x {len(routes)} routes ({'with' if has_delete else 'no'} DELETE route) "
               f"answers={dict(sorted(answers.items(), key=str))} real file readable={readable} "
               f"look-alike input_file_ids={dict(Counter(batch_answers.values()))}")
    return Result("traversal", not problems, figures, "; ".join(problems))


def look_alike_batches(client: httpx.Client, server: Server, real: str) -> dict[str, int]:
    """A batch on each look-alike of the real file's id: the answer's status by spelling. One that
    was taken (200) named the real file by another spelling, which let its input be deleted under it."""
    spellings = [f"x/{real}", f"../files/{real}", f"{real}.json", real.upper(), f" {real}", f"{real}/"]
    return {spelling: client.post(f"{server.v1}/batches", json={
        "input_file_id": spelling, "endpoint": "/v1/completions", "completion_window": "24h"}).status_code
        for spelling in spellings}


def check_batch_restart(ctx: Context) -> Result:
    """A batch survives a kill -9 of its server: the next start resumes it from its output files."""
    lines, kill_at = (60, 20) if ctx.quick else (150, 50)
    server = Server(ctx.children, ctx.workdir("batch-restart"))
    server.start()
    # Staggered lengths (4-11 tokens), so results trickle in and the kill lands near `kill_at`
    # rather than after a whole batch of 32 finished at once.
    data = "".join(completion_line(f"r-{i}", f"Item {i}: a short story about a cat", max_tokens=4 + i % 8,
                                   model=MODEL, temperature=0, ignore_eos=True) + "\n" for i in range(lines))
    with httpx.Client(trust_env=False, timeout=30) as client:
        upload = client.post(f"{server.v1}/files", files={"file": ("in.jsonl", data.encode())},
                             data={"purpose": "batch"})
        upload.raise_for_status()
        batch = client.post(f"{server.v1}/batches", json={"input_file_id": upload.json()["id"],
                                                          "endpoint": "/v1/completions", "completion_window": "24h"})
        batch.raise_for_status()
        batch_id = batch.json()["id"]
        seen: dict = {}

        def progressed() -> bool:
            seen.update(client.get(f"{server.v1}/batches/{batch_id}").json())
            return seen["request_counts"]["completed"] >= kill_at or seen["status"] not in ("validating", "in_progress")

        wait_until(progressed, 300, f"{kill_at} lines done", interval=0.1)
    at_kill = seen["request_counts"]["completed"]
    server.kill()
    if seen["status"] != "in_progress" or at_kill >= lines:
        raise CheckFailed(f"the batch was {seen['status']} with {at_kill}/{lines} done at the kill: not mid-batch")

    restart_s = server.start()
    with httpx.Client(trust_env=False, timeout=30) as client:
        def finished() -> bool:
            seen.update(client.get(f"{server.v1}/batches/{batch_id}").json())
            return seen["status"] in ("completed", "failed", "cancelled", "expired")

        resume_s = wait_until(finished, 600, "the batch to finish after the restart", interval=0.2)

        def content(file_id: str | None) -> str:
            return client.get(f"{server.v1}/files/{file_id}/content").text if file_id else ""

        output, errors = content(seen["output_file_id"]), content(seen["error_file_id"])
    ids = [json.loads(line)["custom_id"] for line in output.splitlines() if line.strip()]
    counts = seen["request_counts"]
    problems = []
    if seen["status"] != "completed" or counts != {"total": lines, "completed": lines, "failed": 0}:
        problems.append(f"status {seen['status']}, request_counts {counts}")
    if sorted(ids) != sorted(f"r-{i}" for i in range(lines)):
        problems.append(f"output rows {len(ids)}, unique {len(set(ids))}, duplicates {duplicates(ids)[:5]}")
    if errors.strip():
        problems.append(f"error file has {len(errors.splitlines())} rows")
    figures = (f"killed at {at_kill}/{lines}; restart {restart_s:.1f} s; then {seen['status']} "
               f"{counts['completed']}/{counts['total']} (failed {counts['failed']}) after {resume_s:.1f} s; "
               f"output rows={len(ids)} unique={len(set(ids))}")
    return Result("batch-restart", not problems, figures, "; ".join(problems))


# Polls /health from its own process until stdin closes, then prints the slowest answer and the
# failures: polling from a thread of this script would also time this script's own GIL (it reads
# a stream and sends megabytes meanwhile), not just the server.
HEALTH_PROBE = """
import sys, threading, time, httpx
url, worst, fails, stop = sys.argv[1], [0.0], [0], threading.Event()
def poll():
    with httpx.Client(trust_env=False, timeout=10) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                fails[0] += client.get(url).status_code != 200
            except httpx.HTTPError:
                fails[0] += 1
            worst[0] = max(worst[0], time.monotonic() - start)
            time.sleep(0.02)
thread = threading.Thread(target=poll, daemon=True)
thread.start()
print("polling", flush=True)
sys.stdin.read()
stop.set()
thread.join(timeout=15)
print(worst[0], fails[0], flush=True)
"""
HEALTH_WITHIN_S = 0.1
ANSWER_WITHIN_S = 3.0  # refusing by size or by length needs no tokenizing: a loopback transfer at most


@dataclass
class BigOutcome:
    status: int | str
    code: str | None
    answer_s: float
    worst_health_s: float
    health_fails: int
    chunks_after: int
    max_gap_s: float


@contextlib.contextmanager
def beside_a_stream(ctx: Context, server: Server) -> Iterator[Callable[[], tuple[float, int, list[float]]]]:
    """A long stream on a thread and the /health probe process, running while the body is sent.
    Yields a function that stops both and returns (worst health s, health failures, chunk times)."""
    chunk_times: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with contextlib.suppress(httpx.HTTPError), httpx.Client(trust_env=False, timeout=120) as client, \
                client.stream("POST", f"{server.v1}/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk_times.append(time.monotonic())
                if done.is_set():
                    return

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    probe = ctx.children.start([sys.executable, "-c", HEALTH_PROBE, f"{server.url}/health"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
    assert probe.stdout is not None and probe.stdout.readline() == "polling\n"
    wait_until(lambda: len(chunk_times) >= 3, 60, "the stream started")

    def stop() -> tuple[float, int, list[float]]:
        done.set()
        out, _ = probe.communicate(timeout=60)
        thread.join(timeout=60)
        worst, fails = out.split()
        return float(worst), int(fails), chunk_times

    try:
        yield stop
    finally:
        done.set()


def send_big(ctx: Context, server: Server, body: bytes) -> BigOutcome:
    with beside_a_stream(ctx, server) as stop:
        start = time.monotonic()
        try:
            response = httpx.post(f"{server.v1}/completions", content=body, timeout=120, trust_env=False,
                                  headers={"content-type": "application/json"})
            status: int | str = response.status_code
            try:
                code = response.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = None
        except httpx.HTTPError as exc:
            status, code = type(exc).__name__, None
        end = time.monotonic()
        time.sleep(0.5)
        worst, fails, chunks = stop()
    during = [t for t in chunks if start <= t <= end + 0.5]
    gaps = [b - a for a, b in zip([start, *during], [*during, end + 0.5], strict=True)]
    return BigOutcome(status, code, end - start, worst, fails, sum(end <= t <= end + 0.5 for t in chunks), max(gaps))


def check_big_request(ctx: Context) -> Result:
    """One huge request never stalls the others: a body over the limit is refused before it is
    read, a prompt far over the context before it is tokenized (tokenizing 20 MB took ~50 s)."""
    flag = has_flag("serve", "--max-request-bytes")
    server = Server(ctx.children, ctx.workdir("big-request"))  # the default body limit (10 MiB where it exists)
    server.start()

    def prompt_body(size: int) -> bytes:  # built as bytes: json.dumps of megabytes would only cost time here
        return b'{"model": "%s", "max_tokens": 2, "prompt": "%s"}' % (MODEL.encode(), b"word " * (size // 5))

    cases = [("20MB body", prompt_body(20 * 10**6), 413, "request_too_large"),
             ("8MB prompt", prompt_body(8 * 10**6), 400, "context_length_exceeded")]
    parts, problems = [], []
    for name, body, want_status, want_code in cases:
        got = send_big(ctx, server, body)
        parts.append(f"{name}: {got.status} {got.code} in {got.answer_s:.2f} s, health worst "
                     f"{got.worst_health_s * 1000:.0f} ms, stream gap max {got.max_gap_s:.2f} s, "
                     f"{got.chunks_after} chunks in the next 0.5 s")
        if (got.status, got.code) != (want_status, want_code):
            problems.append(f"{name}: {got.status} {got.code}, expected {want_status} {want_code}")
        if got.answer_s > ANSWER_WITHIN_S:
            problems.append(f"{name}: answered after {got.answer_s:.1f} s (> {ANSWER_WITHIN_S} s)")
        if got.worst_health_s >= HEALTH_WITHIN_S or got.health_fails:
            problems.append(f"{name}: /health worst {got.worst_health_s * 1000:.0f} ms, {got.health_fails} failed")
        if got.chunks_after < 1:
            problems.append(f"{name}: the stream stopped")
    if not flag:
        problems.insert(0, "tokenmill serve has no --max-request-bytes yet (the body limit has not landed)")
    return Result("big-request", not problems, "; ".join(parts), "; ".join(problems))


FAIR_SHORT_WITHIN_S = 0.5
FAIR_PROMPT_BYTES = 1_300_000


def longest_tokenized_prompt(server: Server, wanted: int) -> int:
    """`wanted`, or less where the server would refuse a prompt that long by its length alone (without
    tokenizing it, which is not what this check is about): its 400 says how many characters it takes."""
    body = {"model": MODEL, "prompt": "word " * (wanted // 5), "max_tokens": 1}
    refused = httpx.post(f"{server.v1}/completions", json=body, timeout=120, trust_env=False)
    message = refused.json().get("error", {}).get("message", "") if refused.status_code == 400 else ""
    if "without tokenizing" not in message:
        return wanted
    return int(message.split("at most ")[1].split(" characters")[0].replace(",", "")) - 1000


def check_fair_tokenize(ctx: Context) -> Result:
    """A short request is not queued behind long prompts being tokenized (serve/backend.py's lanes)."""
    server = Server(ctx.children, ctx.workdir("fair-tokenize"), "--max-model-len", "8192")
    server.start()
    size = longest_tokenized_prompt(server, FAIR_PROMPT_BYTES)
    long_body = b'{"model": "%s", "max_tokens": 1, "prompt": "%s"}' % (MODEL.encode(), b"word " * (size // 5))
    short_body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

    async def measure() -> tuple[float, float, list[int | str], float]:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            start = time.monotonic()
            (await client.post(f"{server.v1}/completions", json=short_body)).raise_for_status()
            alone = time.monotonic() - start

            async def post_long() -> int | str:
                try:
                    return (await client.post(f"{server.v1}/completions", content=long_body,
                                              headers={"content-type": "application/json"})).status_code
                except httpx.HTTPError as exc:
                    return type(exc).__name__

            began = time.monotonic()
            longs = [asyncio.create_task(post_long()) for _ in range(4)]
            await asyncio.sleep(0.5)  # the four are sent and being tokenized
            start = time.monotonic()
            short = await client.post(f"{server.v1}/completions", json=short_body)
            loaded = time.monotonic() - start if short.status_code == 200 else float("inf")
            statuses = list(await asyncio.gather(*longs))
            return alone, loaded, statuses, time.monotonic() - began

    alone, loaded, statuses, long_s = asyncio.run(measure())
    figures = (f"2-token request alone {alone:.2f} s, beside 4 x {size / 1e6:.2f} MB prompts {loaded:.2f} s "
               f"(goal < {FAIR_SHORT_WITHIN_S} s); the long ones: {dict(Counter(statuses))} in {long_s:.1f} s")
    problems = [] if loaded < FAIR_SHORT_WITHIN_S else [f"the short request took {loaded:.2f} s"]
    return Result("fair-tokenize", not problems, figures, "; ".join(problems))


def check_endpoint_restart(ctx: Context) -> Result:
    """An endpoint job rides out its server restarting: requests that meet the outage wait and retry
    until it is back, so the job still ends with every row done once and exit 0."""
    lines = 150
    work = ctx.workdir("endpoint-restart")
    retry_for = has_flag("run", "--retry-for")
    server = Server(ctx.children, work)
    server.start()
    path = work / "input.jsonl"
    path.write_text("".join(completion_line(f"e-{i}", f"Note {i}: the meeting moved to Tuesday.", max_tokens=16,
                                            temperature=0, ignore_eos=True) + "\n" for i in range(lines)))
    out = work / "out"
    results, errors = out / "results.jsonl", out / "errors.jsonl"
    cmd = tokenmill("run", str(path), "-o", str(out), "--endpoint", f"{server.v1}", "--model", MODEL,
                    "--concurrency", "16", "--no-progress")
    job_log = work / "job.log"
    job = ctx.children.start(cmd, job_log)
    started = time.monotonic()
    wait_until(lambda: count_lines(results) >= 1 or job.poll() is not None, 120, "a first result")
    wait_until(lambda: time.monotonic() - started >= 5 or job.poll() is not None, 10, "5 s into the job")
    at_kill = count_lines(results)
    if job.poll() is not None or at_kill >= lines:
        raise CheckFailed(f"the job ended (exit {job.returncode}, {at_kill} rows) before the kill: make it longer")
    server.kill()
    killed = time.monotonic()
    time.sleep(10)
    load_s = server.start()
    outage_s = time.monotonic() - killed
    try:
        code = job.wait(timeout=600)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"the job did not end within 600 s after the restart\n{tail(job_log)}") from exc

    ids = [r["custom_id"] for r in read_rows(results)]
    error_codes = Counter(r["error"]["code"] for r in read_rows(errors))
    problems = []
    if code != 0:
        problems.append(f"exit {code}")
    if sorted(ids) != sorted(f"e-{i}" for i in range(lines)):
        problems.append(f"{lines - len(set(ids))} rows not done, duplicates {duplicates(ids)[:5]}")
    if error_codes:
        problems.append(f"error rows {dict(error_codes)} (given up during the outage)")
    if not retry_for:
        problems.append("tokenmill run has no --retry-for yet (the time-based retry budget has not landed)")
    figures = (f"rows at kill={at_kill}/{lines}; outage {outage_s:.1f} s (down 10 s + load {load_s:.1f} s); "
               f"exit {code}; results={len(ids)} unique={len(set(ids))} errors={dict(error_codes)}")
    return Result("endpoint-restart", not problems, figures, "; ".join(problems))


CHECKS: dict[str, Callable[[Context], Result]] = {
    "kill": check_kill,
    "streams": check_streams,
    "traversal": check_traversal,
    "batch-restart": check_batch_restart,
    "big-request": check_big_request,
    "fair-tokenize": check_fair_tokenize,
    "endpoint-restart": check_endpoint_restart,
}


def run_check(name: str, ctx: Context) -> Result:
    """One check, isolated: a crash in it is its FAIL, and its children die before the next starts."""
    start = time.monotonic()
    try:
        result = CHECKS[name](ctx)
    except CheckFailed as exc:
        result = Result(name, False, "-", str(exc))
    except Exception as exc:  # a bug in the check or a server that misbehaves in a new way: report, go on
        result = Result(name, False, "-", f"crashed: {type(exc).__name__}: {exc}")
    finally:
        ctx.children.kill_all()
    result.seconds = time.monotonic() - start
    return result


def main() -> int:
    if sys.argv[1:2] == ["soak"]:  # a run of its own (mixed traffic for minutes), not a check: benchmarks/soak.py
        import soak

        return soak.main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=list(CHECKS), action="append", help="run this check (repeatable)")
    parser.add_argument("--quick", action="store_true", help="smaller counts (same conditions)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (logs, outputs)")
    args = parser.parse_args()
    # SIGTERM to this script becomes an exception, so the finally blocks kill the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    results = []
    with workspace("tokenmill-stress-", args.keep_tmp) as (children, tmp):
        ctx = Context(quick=args.quick, tmp=tmp, children=children)
        for name in args.only or list(CHECKS):
            print(f"  running {name} ...", file=sys.stderr, flush=True)
            result = run_check(name, ctx)
            results.append(result)
            print(f"{'PASS' if result.passed else 'FAIL'}  {result.name:<17} {result.figures}  "
                  f"[{result.seconds:.0f} s]", flush=True)
            if result.note:
                print(f"      {result.note}", flush=True)
    failed = [r.name for r in results if not r.passed]
    print(f"{len(results) - len(failed)}/{len(results)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
