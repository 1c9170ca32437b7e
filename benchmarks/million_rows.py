"""The job layer of `tokenmill run --endpoint` at a million rows (and ten million), against a stub
OpenAI endpoint that answers at once: the four figures the issue measured, and whether each goal holds.

    .venv/bin/python benchmarks/million_rows.py                      # everything, full size (see below)
    .venv/bin/python benchmarks/million_rows.py --only throughput    # one check (repeatable)
    .venv/bin/python benchmarks/million_rows.py --rows 5000 --rows-10m 20000 --throughput-rows 2000 \\
        --hold 2 --memory-seconds 3 --results /tmp/mr.json          # a smoke run of the script itself

Prints a table (each figure beside the goal and the issue's measurement of the old code), writes
benchmarks/results/million_rows.json and a chart, benchmarks/results/million_rows.png (a run of
some checks only keeps the other checks' figures from the last run of the same sizes). Exits 1 if
any check fails. Everything runs only `tokenmill run INPUT -o OUT --endpoint URL --concurrency N
--no-progress [--strict]`, as a user would, against benchmarks/stub_openai.py (raw ASGI on uvicorn,
one process), and the baseline, benchmarks/minimal_client.py (~30 lines of asyncio + aiohttp).

Checks, in order. Full-size times are ESTIMATES (from smoke runs at 2,000-20,000 rows on this
2-core machine): most of the time is three 1M-row jobs (memory, resume, kill), each 1M / R s at
the job's rate R: ~6 min each at 3,000 req/s, 40 min at the issue's 420 req/s.

  generate       the inputs, written deterministically (seed 0) in the workdir and reused when
                 the file there has the right size and row count: OpenAI batch lines, custom_id
                 "req-N", POST /v1/chat/completions, body {model, messages: [system, user: varied
                 English words], max_tokens 16}, every line exactly 403 bytes as in the issue's file
                 (403 MB at 1M rows). 403 bytes leave ~160 for the user message, ~26 words (~40
                 tokens at 4 bytes a token): the issue's "~150-token requests" cannot fit in its
                 403 bytes, and the bytes are what the job layer reads. Also the --throughput-rows
                 file (the first rows of the same stream). ~7 µs a line: ~10 s for 1M rows, ~1.5 min
                 for 10M (4 GB of disk).
  first-request  time from Popen to the stub's first POST, `--concurrency 64`, over the 1M file and
                 the 10M file; each job runs --hold s more, then SIGINT (exit 130). Goal ≤ 2 s. ~30 s.
  memory         peak RSS (VmRSS polled every 50 ms, and VmHWM, the kernel's own peak, as wait4's
                 ru_maxrss at exit; the larger is judged) of a full run over the 1M file — whose
                 req/s and CPU (tokenmill's, the stub's) are the issue's "~420 req/s at 99 %" line —,
                 of a run over the 10M file stopped --memory-seconds after its first request, and of
                 a `--strict` run over the 10M file (every line validated before sending: the case
                 that grows with rows), stopped --hold s after its first request. Goal < 300 MB
                 (10^6 bytes) each. 1M / R + ~2 min.
  resume         a run SIGKILLed once its results file has --resume-done rows (default 1,000,000 of
                 the 10M file; without the 10M file, 99 % of the 1M file), then the same command
                 again: time from its Popen to the stub's first POST (stats reset between), and its
                 peak RSS over --hold s of sending. Goals ≤ 3 s, < 300 MB. 1M / R + ~15 s.
  throughput     for each --concurrency: the minimal client and tokenmill over the --throughput-rows
                 file against the same stub process, alternating which goes first, --rounds 2:
                 req/s (rows / wall from Popen to exit, start-up included for both), each client's
                 CPU (wait4's rusage) and the stub's (/proc/PID/stat deltas), the ratio of the
                 medians. Goal tokenmill ≥ 0.8× minimal. 8 × 30,000 / R s: ~2-3 min near 3,000 req/s.
                 The client's aiohttp is this virtualenv's; where it lacks one, Ray's vendored
                 copy is put on the client's PYTHONPATH (and the report says so).
  kill           a job over the 1M file SIGKILLed at --kills seeded random points (each a number of
                 result lines reached, one in each equal slice of 2-98 % of the rows), then run to
                 the end; every custom_id of the input exactly once across results.jsonl and
                 errors.jsonl, nothing else (the files streamed, one byte of count per input row;
                 ~16 s at 1M rows). 1M / R + ~1 min.

Whole run, full size: ~25 min at ~3,000 req/s; ~50 min at the ~1,000-1,500 req/s of the last
smoke runs (2,000-20,000 rows, the other core busy, the job layer mid-rewrite); ~2.2 h at the
issue's 420 req/s (estimates, all).

With every figure: the CPU that other processes on the machine used during that run (all busy
time in /proc/stat minus the measured client, the stub and this script, in cores) and the
1-minute load average at its start; a busy machine makes the figures worthless, so look.
Children run in their own sessions and are SIGKILLed (group) when their check ends.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import random
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
STUB = BENCH / "stub_openai.py"
MINIMAL = BENCH / "minimal_client.py"
DEFAULT_WORKDIR = BENCH / ".work"
DEFAULT_RESULTS = BENCH / "results" / "million_rows.json"

LINE_BYTES = 403  # the issue's file: 403 MB for 1,000,000 rows
SEED = 0
FORMAT_VERSION = 1  # of generated inputs: bump when the generator changes, so cached files are rewritten
MODEL = "stub-model"

GOAL_FIRST_S = 2.0
GOAL_RESUME_S = 3.0
GOAL_RSS_MB = 300.0
GOAL_RATIO = 0.8
# The issue's measurements of the old job layer (this machine, same stub, 1M rows, --concurrency 64).
ISSUE = {"first_request_s": 30.0, "req_s": 420, "tokenmill_cpu_pct": 99, "stub_cpu_pct": 17,
         "rss_mb_1m": [560, 610], "resume_done": 74_227, "resume_first_s": 26.7, "resume_rss_mb": 800}

POLL_S = 0.05
STUB_POLL_S = 0.25  # how often the stub's /stats is asked while waiting for a first request
SIGINT_GRACE_S = 60.0  # a clean stop that takes longer than this is SIGKILLed (and said so)
MIN_REQ_S = 100.0  # for timeouts only: a run slower than this fails by timing out
CLK_TCK = os.sysconf("SC_CLK_TCK")


def first_timeout(rows: int) -> float:
    """How long to wait for a first request: generous, the old code took 30 s per million rows."""
    return 60.0 + 60.0 * rows / 1e6


def run_timeout(rows: int) -> float:
    return first_timeout(rows) + rows / MIN_REQ_S


class CheckFailed(Exception):
    """The setup of a check went wrong (a stub that never came up, a job that ended before its
    kill): the check fails with this message instead of measuring something meaningless."""


# ---- processes --------------------------------------------------------------------------------------


class Children:
    """Every process a check starts, so that all of them die when the check ends, whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with log.open("ab") as out:
            # Own session: a Ctrl-C on the terminal reaches only this script, which kills the children.
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(), **(env or {})}, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.returncode is None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
                    proc.wait(timeout=30)
        self.procs.clear()


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost")
    for name in ("TOKENMILL_API_KEY", "OPENAI_API_KEY"):  # a key would make the job send it: not what is measured
        env.pop(name, None)
    return env


def tokenmill_command() -> list[str]:
    script = Path(sys.executable).parent / "tokenmill"  # the console script of this virtualenv, as a user runs it
    return [str(script)] if script.exists() else [sys.executable, "-m", "tokenmill"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 12) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def aiohttp_env() -> tuple[dict[str, str] | None, str]:
    """(extra environment for the minimal client, where its aiohttp comes from). When this
    virtualenv lacks aiohttp, Ray's vendored copy (a full build, C parser included) is put on the
    client's PYTHONPATH, and the report says so."""
    if importlib.util.find_spec("aiohttp"):
        import aiohttp

        return {}, f"aiohttp {aiohttp.__version__} (this virtualenv)"
    ray = importlib.util.find_spec("ray")
    if ray and ray.origin:
        vendored = Path(ray.origin).parent / "_private" / "runtime_env" / "agent" / "thirdparty_files"
        found = sorted(vendored.glob("aiohttp-*.dist-info"))
        if found:
            version = found[-1].name.removeprefix("aiohttp-").removesuffix(".dist-info")
            where = vendored.relative_to(ROOT) if vendored.is_relative_to(ROOT) else vendored
            return ({"PYTHONPATH": str(vendored)},
                    f"aiohttp {version} from Ray's vendored copy ({where}): not installed in this virtualenv")
    return None, "aiohttp is not installed in this virtualenv (nor vendored by Ray): the minimal client cannot run"


# ---- /proc ------------------------------------------------------------------------------------------


def machine_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all CPUs; idle and iowait excluded)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / CLK_TCK


def pid_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def pid_mem_kb(pid: int) -> tuple[int | None, int | None]:
    """(VmRSS, VmHWM) in kB; None where unreadable (the process is gone or a zombie)."""
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return rss, hwm


def all_pids_cpu() -> dict[int, tuple[float, str]]:
    """Every process's CPU seconds so far and its name: to say who else was busy."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as stat:
                    text = stat.read()
                name = text[text.index("(") + 1:text.rindex(")")]
                fields = text.rpartition(")")[2].split()
                out[int(entry)] = ((int(fields[11]) + int(fields[12])) / CLK_TCK, name)
    return out


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mb(kb: float | None) -> float | None:
    return None if kb is None else kb * 1024 / 1e6


class LineCounter:
    """Lines of a growing file, counted incrementally (a full recount only if it shrank)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.lines = path, 0, 0

    def update(self) -> int:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = self.lines = 0
            return 0
        if size < self.offset:  # rewritten or a torn tail cut: count again
            self.offset = self.lines = 0
        if size > self.offset:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                while self.offset < size:
                    chunk = f.read(min(1 << 22, size - self.offset))
                    if not chunk:
                        break
                    self.lines += chunk.count(b"\n")
                    self.offset += len(chunk)
        return self.lines


# ---- the stub ---------------------------------------------------------------------------------------


class Stub:
    """benchmarks/stub_openai.py in its own process; /stats/reset before each measured run."""

    def __init__(self, children: Children, log: Path) -> None:
        self.port = free_port()
        self.proc = children.start([sys.executable, str(STUB), "--port", str(self.port)], log)
        self.client = httpx.Client(trust_env=False, timeout=10)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise CheckFailed(f"the stub exited with {self.proc.returncode}:\n{tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                self.info = self.stats()
                return
            if time.monotonic() > deadline:
                raise CheckFailed(f"the stub did not answer within 30 s:\n{tail(log)}")
            time.sleep(0.1)

    @property
    def v1(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, Any]:
        return self.client.get(f"http://127.0.0.1:{self.port}/stats").json()

    def reset(self) -> None:
        self.client.post(f"http://127.0.0.1:{self.port}/stats/reset").raise_for_status()

    def cpu_s(self) -> float:
        return pid_cpu_s(self.proc.pid) or 0.0


# ---- one measured run -------------------------------------------------------------------------------


@dataclass
class Run:
    label: str
    command: str
    exit_code: int | None = None
    signal_sent: str | None = None
    note: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0  # the client's own user + system (wait4)
    peak_rss_mb: float | None = None  # the largest VmRSS seen by the 50 ms poll
    hwm_mb: float | None = None  # ru_maxrss at exit: the kernel's peak (VmHWM)
    first_request_s: float | None = None  # Popen → the stub's first POST
    rows_before: int = 0  # lines in the results file before the run
    rows_after: int = 0
    stub_requests: int = 0
    stub_span_s: float | None = None  # the stub's first POST → its last
    stub_cpu_s: float = 0.0
    self_cpu_s: float = 0.0
    others_cores: float = 0.0  # other processes on the machine, cores in use on average over the run
    load1: float = 0.0  # the 1-minute load average at the start
    busiest_others: list[str] = field(default_factory=list)

    @property
    def rows_new(self) -> int:
        return self.rows_after - self.rows_before

    @property
    def req_s(self) -> float:
        return self.rows_new / self.wall_s if self.wall_s else 0.0

    @property
    def cpu_pct(self) -> float:
        return 100 * self.cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def stub_pct(self) -> float:
        return 100 * self.stub_cpu_s / self.wall_s if self.wall_s else 0.0

    @property
    def peak_mb(self) -> float | None:
        values = [v for v in (self.peak_rss_mb, self.hwm_mb) if v is not None]
        return max(values) if values else None

    def machine(self) -> str:
        busiest = f" ({self.busiest_others[0]})" if self.others_cores >= 0.1 and self.busiest_others else ""
        return f"others {self.others_cores:.2f} cores{busiest} · load {self.load1:.2f}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows_new": self.rows_new, "req_s": self.req_s, "cpu_pct": self.cpu_pct,
                "stub_pct": self.stub_pct, "peak_mb": self.peak_mb}


class Watch:
    """What a stop rule sees while a run goes on."""

    def __init__(self, stub: Stub, counter: LineCounter | None, t0: float) -> None:
        self.stub, self.counter, self.t0, self.started = stub, counter, t0, time.monotonic()
        self.rows_before = counter.lines if counter else 0
        self.rows = self.rows_before
        self._first_at: float | None = None
        self._asked = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def first_request_s(self) -> float | None:
        """Seconds from Popen to the first POST, asking the stub at most every 0.25 s."""
        if self._first_at is None and time.monotonic() - self._asked >= STUB_POLL_S:
            self._asked = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                self._first_at = self.stub.stats()["first_request_at"]
        return None if self._first_at is None else self._first_at - self.t0

    def since_first(self) -> float | None:
        first = self.first_request_s()
        return None if first is None else time.time() - self.t0 - first


StopRule = Callable[[Watch], "signal.Signals | None"]


def after_first(seconds: float, sig: signal.Signals = signal.SIGINT) -> StopRule:
    """Stop `seconds` after the first request reached the stub."""
    def rule(w: Watch) -> signal.Signals | None:
        since = w.since_first()
        return sig if since is not None and since >= seconds else None
    return rule


def at_rows(rows: int, sig: signal.Signals = signal.SIGKILL) -> StopRule:
    """Stop once the results file has `rows` lines (at least one new one this run)."""
    def rule(w: Watch) -> signal.Signals | None:
        return sig if w.rows >= max(rows, w.rows_before + 1) else None
    return rule


def measure(ctx: Context, label: str, cmd: list[str], results: Path | None, *, stop: StopRule | None = None,
            timeout: float, first_within: float | None = None, env: dict[str, str] | None = None) -> Run:
    """Start `cmd`, sample it every 50 ms until it exits (stopping it by `stop`), and say what it cost."""
    assert ctx.stub is not None
    stub = ctx.stub
    stub.reset()
    counter = LineCounter(results) if results else None
    if counter:
        counter.update()  # before the start: a resume's big file is not read while the job starts
    run = Run(label, shlex.join(cmd))
    run.load1 = os.getloadavg()[0]
    others0, busy0, self0, stub0 = all_pids_cpu(), machine_busy_s(), self_cpu_s(), stub.cpu_s()
    log = ctx.rundir / f"{ctx.next_log()}-{re.sub(r'[^A-Za-z0-9.=]+', '-', label).strip('-')}.log"
    t0 = time.time()
    proc = ctx.children.start(cmd, log, env)
    watch = Watch(stub, counter, t0)
    peak_kb, sent_at = 0, 0.0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss, _ = pid_mem_kb(proc.pid)
        peak_kb = max(peak_kb, rss or 0)
        if counter:
            watch.rows = counter.update()
        elapsed = watch.elapsed()
        if run.signal_sent is None:
            sig = stop(watch) if stop else None
            if sig is None and elapsed > timeout:
                sig, run.note = signal.SIGKILL, f"timed out after {timeout:.0f} s"
            if sig is None and first_within is not None and elapsed > first_within and watch.first_request_s() is None:
                sig, run.note = signal.SIGKILL, f"no request within {first_within:.0f} s"
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)
                run.signal_sent, sent_at = sig.name, elapsed
        elif run.signal_sent != "SIGKILL" and elapsed - sent_at > SIGINT_GRACE_S:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            run.note += f"; {run.signal_sent} did not stop it within {SIGINT_GRACE_S:.0f} s: SIGKILLed"
            run.signal_sent += "+SIGKILL"
        time.sleep(POLL_S)
    run.wall_s = time.monotonic() - watch.started
    proc.returncode = run.exit_code = os.waitstatus_to_exitcode(status)
    run.cpu_s = usage.ru_utime + usage.ru_stime
    run.hwm_mb = mb(usage.ru_maxrss)  # kB on Linux
    run.peak_rss_mb = mb(peak_kb) if peak_kb else None
    busy1, self1, stub1 = machine_busy_s(), self_cpu_s(), stub.cpu_s()
    others1 = all_pids_cpu()
    run.stub_cpu_s, run.self_cpu_s = stub1 - stub0, self1 - self0
    ours = run.cpu_s + run.stub_cpu_s + run.self_cpu_s
    run.others_cores = max(0.0, busy1 - busy0 - ours) / run.wall_s
    mine = {os.getpid(), stub.proc.pid, proc.pid}
    deltas = sorted(((others1[p][0] - c, others1[p][1]) for p, (c, _) in others0.items()
                     if p in others1 and p not in mine), reverse=True)
    run.busiest_others = [f"{name} {cpu:.1f} s" for cpu, name in deltas[:3] if cpu >= 0.1]
    stats = stub.stats()
    run.stub_requests = stats["requests"]
    if stats["first_request_at"] is not None:
        run.first_request_s = stats["first_request_at"] - t0
        run.stub_span_s = stats["last_request_at"] - stats["first_request_at"]
    run.rows_before = watch.rows_before
    run.rows_after = counter.update() if counter else 0
    if run.exit_code not in (0, 130, -signal.SIGKILL):
        run.note = "; ".join(filter(None, [run.note, f"exit {run.exit_code}: {tail(log, 6)}"]))
    ctx.runs.append(run)
    print(f"    {label}: exit {run.exit_code}{f' after {run.signal_sent}' if run.signal_sent else ''}, "
          f"rows {run.rows_before:,} → {run.rows_after:,} in {run.wall_s:.1f} s ({run.req_s:,.0f} rows/s), "
          f"first request {fmt_s(run.first_request_s)}, peak RSS {fmt_mb(run.peak_mb)}, CPU {run.cpu_pct:.0f}%, "
          f"stub {run.stub_pct:.0f}%, {run.machine()}" + (f" — {run.note}" if run.note else ""),
          file=sys.stderr, flush=True)
    return run


def fmt_s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def fmt_mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} MB"


# ---- inputs -----------------------------------------------------------------------------------------

WORDS = """
the of and to in is that it for on was with as be at by this had from or have an they which one you were
all we her she there would their will when who him been has more if no out do so can what up said about
other into than its time only could new them man some these then two first may any like now my such make
over our even most me state after also made many did must before back see through way where get much go
well your know should down work year because come people just say each those take day good how long very
still own find here thing give many again same last might never under while house world below know place
river mountain garden kitchen window letter market school harbor village forest meadow station library
bridge castle valley island desert ocean summer winter autumn spring morning evening midnight journey
question answer reason method result system problem service product review customer order delivery price
quality battery screen keyboard camera speaker charger cable laptop phone tablet monitor printer router
quickly slowly carefully quietly gently rarely often always sometimes usually clearly simply nearly
bright dark heavy light small large narrow wide warm cold fresh stale sweet bitter smooth rough loud soft
happy tired curious patient honest brave clever gentle proud calm eager famous hungry lucky nervous polite
write read build break carry choose decide explain follow gather handle imagine listen measure notice
offer prepare protect remember repair return share support travel wonder describe compare summarise
translate classify extract rewrite improve shorten expand correct label rank score list outline draft
""".split()  # noqa: SIM905  (a word list reads better as text)
SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant. Answer in one line.",
           "You label customer reviews.", "You summarise documents for busy readers.",
           "You are a careful translator."]
TASKS = ["Summarise:", "Classify the tone of:", "Extract the main topic of:", "Rewrite more simply:",
         "Answer briefly:", "Give a title for:"]


def request_line(i: int, rng: random.Random, line_bytes: int = LINE_BYTES) -> str:
    """Row i: exactly `line_bytes` bytes with its newline (the user message fills the rest)."""
    head = (f'{{"custom_id": "req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": {{"model": '
            f'"{MODEL}", "messages": [{{"role": "system", "content": "{rng.choice(SYSTEMS)}"}}, '
            '{"role": "user", "content": "')
    end = '"}], "max_tokens": 16}}\n'
    need = line_bytes - len(head) - len(end)
    text = rng.choice(TASKS) + " " + " ".join(rng.choices(WORDS, k=need // 4))
    while len(text) < need:
        text += " " + rng.choice(WORDS)
    text = text[:need]
    if text.endswith(" "):
        text = text[:-1] + "s"
    return head + text + end


@dataclass
class InputInfo:
    path: str
    rows: int
    bytes: int
    seconds: float
    cached: bool
    words_per_user_message: float


def generate(path: Path, rows: int, line_bytes: int = LINE_BYTES, seed: int = SEED) -> InputInfo:
    """The input of `rows` lines, deterministic: a file of N rows is the first N of any larger one."""
    meta_path = path.with_name(path.name + ".meta.json")
    want = {"rows": rows, "line_bytes": line_bytes, "seed": seed, "format": FORMAT_VERSION}
    sample = request_line(0, random.Random(seed), line_bytes)
    words = len(json.loads(sample)["body"]["messages"][1]["content"].split())
    if path.exists() and meta_path.exists() and path.stat().st_size == rows * line_bytes:
        with contextlib.suppress(ValueError, OSError):
            if json.loads(meta_path.read_text()) == want:
                with path.open("rb") as f:  # the last line is row rows-1: the count is right
                    f.seek(-line_bytes, os.SEEK_END)
                    if f.read(line_bytes).startswith(b'{"custom_id": "req-%d"' % (rows - 1)):
                        return InputInfo(str(path), rows, path.stat().st_size, 0.0, True, words)
    if shutil.disk_usage(path.parent).free < rows * line_bytes * 1.1 + 1e9:
        raise CheckFailed(f"not enough disk for {rows:,} rows ({rows * line_bytes / 1e9:.1f} GB) in {path.parent}")
    print(f"    generating {path.name}: {rows:,} rows of {line_bytes} bytes ({rows * line_bytes / 1e6:,.0f} MB) ...",
          file=sys.stderr, flush=True)
    start = time.monotonic()
    rng = random.Random(seed)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="ascii", buffering=1 << 20) as out:
        for base in range(0, rows, 10_000):
            out.writelines(request_line(i, rng, line_bytes) for i in range(base, min(rows, base + 10_000)))
    meta_path.unlink(missing_ok=True)
    tmp.rename(path)
    meta_path.write_text(json.dumps(want))
    return InputInfo(str(path), rows, path.stat().st_size, time.monotonic() - start, False, words)


# ---- checks -----------------------------------------------------------------------------------------


@dataclass
class Figure:
    check: str
    what: str
    value: str
    goal: str = ""
    issue: str = ""
    machine: str = ""
    passed: bool | None = None  # None: information, no goal
    note: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    args: argparse.Namespace
    workdir: Path
    rundir: Path
    children: Children
    stub: Stub | None = None
    runs: list[Run] = field(default_factory=list)
    inputs: dict[int, InputInfo] = field(default_factory=dict)
    logs: int = 0

    def next_log(self) -> str:
        self.logs += 1
        return f"{self.logs:02d}"

    def input(self, rows: int) -> Path:
        if rows not in self.inputs:
            self.inputs[rows] = info = generate(self.workdir / "inputs" / f"rows-{rows}.jsonl", rows)
            how = "cached" if info.cached else f"written in {info.seconds:.1f} s"
            print(f"    input {Path(info.path).name}: {rows:,} rows, {info.bytes:,} bytes "
                  f"({info.bytes / rows:.0f} B/line, ~{info.words_per_user_message} words a user message), {how}",
                  file=sys.stderr, flush=True)
        return Path(self.inputs[rows].path)

    def sizes(self) -> list[int]:
        return [self.args.rows] + ([self.args.rows_10m] if self.args.rows_10m else [])

    def fresh(self, *parts: str) -> Path:
        path = self.rundir.joinpath(*parts)
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def start_stub(self) -> Stub:
        self.stub = Stub(self.children, self.rundir / f"{self.next_log()}-stub.log")
        return self.stub

    def job(self, path: Path, out: Path, concurrency: int = 64, *extra: str) -> list[str]:
        assert self.stub is not None
        return [*tokenmill_command(), "run", str(path), "-o", str(out), "--endpoint", self.stub.v1,
                "--concurrency", str(concurrency), "--no-progress", *extra]


def rows_label(rows: int) -> str:
    return f"{rows // 1_000_000}M rows" if rows % 1_000_000 == 0 else f"{rows:,} rows"


def check_generate(ctx: Context) -> list[Figure]:
    figures = []
    for rows in dict.fromkeys([*ctx.sizes(), ctx.args.throughput_rows]):
        ctx.input(rows)
        info = ctx.inputs[rows]
        figures.append(Figure(
            "generate", f"input, {rows_label(rows)}",
            f"{info.bytes / 1e6:,.1f} MB · {info.bytes / rows:.1f} B/line · "
            + ("cached" if info.cached else f"written in {info.seconds:.1f} s"),
            goal=f"{LINE_BYTES} B/line", issue="403 MB at 1M rows" if rows == 1_000_000 else "",
            passed=info.bytes == rows * LINE_BYTES, data=asdict(info)))
    return figures


def job_ok(run: Run, *codes: int) -> str:
    return "" if run.exit_code in codes else f"exit {run.exit_code}, expected {' or '.join(map(str, codes))}"


def check_first_request(ctx: Context) -> list[Figure]:
    ctx.start_stub()
    figures = []
    for rows in ctx.sizes():
        path, out = ctx.input(rows), ctx.fresh("first-request", f"out-{rows}")
        run = measure(ctx, f"first-request {rows_label(rows)}", ctx.job(path, out), out / "results.jsonl",
                      stop=after_first(ctx.args.hold), timeout=run_timeout(rows), first_within=first_timeout(rows))
        problem = run.note or job_ok(run, 0, 130)
        within = run.first_request_s is not None and run.first_request_s <= GOAL_FIRST_S
        figures.append(Figure(
            "first-request", f"Popen → first request, {rows_label(rows)}, c=64",
            fmt_s(run.first_request_s) if run.first_request_s is not None else f"> {first_timeout(rows):.0f} s",
            goal=f"≤ {GOAL_FIRST_S:g} s", issue="30 s (1M rows)" if rows == ctx.args.rows else "",
            machine=run.machine(), passed=within and not problem, note=problem,
            data={"rows": rows, "first_request_s": run.first_request_s, "run": run.label}))
    return figures


def rss_figure(check: str, what: str, run: Run, issue: str, problem: str, total_rows: int | None = None) -> Figure:
    peak = run.peak_mb
    rows = f"{run.rows_after:,}" + (f"/{total_rows:,}" if total_rows else "") + " rows done"
    value = (f"{fmt_mb(peak)} ({rows}; VmRSS max {fmt_mb(run.peak_rss_mb)}, VmHWM {fmt_mb(run.hwm_mb)})"
             if peak is not None else "-")
    return Figure(check, what, value, goal=f"< {GOAL_RSS_MB:g} MB", issue=issue, machine=run.machine(),
                  passed=peak is not None and peak < GOAL_RSS_MB and not problem, note=problem,
                  data={"peak_mb": peak, "rows_done": run.rows_after, "run": run.label})


def check_memory(ctx: Context) -> list[Figure]:
    args = ctx.args
    ctx.start_stub()
    figures = []
    rows = args.rows
    path, out = ctx.input(rows), ctx.fresh("memory", "out-full")
    run = measure(ctx, f"memory {rows_label(rows)} full run", ctx.job(path, out), out / "results.jsonl",
                  timeout=run_timeout(rows), first_within=first_timeout(rows))
    problem = run.note or job_ok(run, 0) or ("" if run.rows_after == rows else f"{run.rows_after:,} of {rows:,} rows")
    figures.append(Figure(
        "memory", f"full run, {rows_label(rows)}, c=64: req/s · CPU",
        f"{run.req_s:,.0f} req/s · tokenmill {run.cpu_pct:.0f}% of a core · stub {run.stub_pct:.0f}% · "
        f"{run.wall_s:,.0f} s", issue="~420 req/s · 99% · stub 17%", machine=run.machine(),
        data={"req_s": run.req_s, "cpu_pct": run.cpu_pct, "stub_pct": run.stub_pct, "run": run.label}))
    figures.append(rss_figure("memory", f"peak RSS, full run, {rows_label(rows)}", run, "560–610 MB", problem, rows))
    big = args.rows_10m or rows
    if args.rows_10m:
        path, out = ctx.input(big), ctx.fresh("memory", "out-big")
        run = measure(ctx, f"memory {rows_label(big)} timed", ctx.job(path, out), out / "results.jsonl",
                      stop=after_first(args.memory_seconds), timeout=run_timeout(big), first_within=first_timeout(big))
        figures.append(rss_figure("memory", f"peak RSS, {rows_label(big)}, {args.memory_seconds:g} s of sending",
                                  run, "grows with rows", run.note or job_ok(run, 0, 130), big))
    path, out = ctx.input(big), ctx.fresh("memory", "out-strict")
    run = measure(ctx, f"memory {rows_label(big)} --strict", ctx.job(path, out, 64, "--strict"),
                  out / "results.jsonl", stop=after_first(args.hold), timeout=run_timeout(big),
                  first_within=first_timeout(big))
    figure = rss_figure("memory", f"peak RSS, {rows_label(big)} --strict (all read first), then {args.hold:g} s",
                        run, "grows with rows", run.note or job_ok(run, 0, 130), big)
    figure.value += f" · first request {fmt_s(run.first_request_s)}"
    figures.append(figure)
    return figures


def check_resume(ctx: Context) -> list[Figure]:
    args = ctx.args
    big = args.rows_10m or args.rows
    done = args.resume_done or (args.rows if args.rows_10m else int(args.rows * 0.99))
    if not 0 < done < big:
        raise CheckFailed(f"--resume-done {done:,} must be between 0 and the file's {big:,} rows")
    ctx.start_stub()
    path, out = ctx.input(big), ctx.fresh("resume", "out")
    results = out / "results.jsonl"
    pre = measure(ctx, f"resume: first run to {done:,} rows, SIGKILL", ctx.job(path, out), results,
                  stop=at_rows(done), timeout=run_timeout(done), first_within=first_timeout(big))
    if pre.exit_code != -signal.SIGKILL:
        raise CheckFailed(f"the first run ended (exit {pre.exit_code}) before {done:,} rows were done: {pre.note}")
    run = measure(ctx, "resume: the same command again", ctx.job(path, out), results, stop=after_first(args.hold),
                  timeout=run_timeout(big), first_within=first_timeout(big))
    problem = run.note or job_ok(run, 0, 130)
    within = run.first_request_s is not None and run.first_request_s <= GOAL_RESUME_S
    return [
        Figure("resume", f"first run to {done:,} rows of {rows_label(big)}, c=64 (killed)",
               f"{pre.req_s:,.0f} req/s · tokenmill {pre.cpu_pct:.0f}% · stub {pre.stub_pct:.0f}% · "
               f"{pre.wall_s:,.0f} s", machine=pre.machine(), data={"req_s": pre.req_s, "run": pre.label}),
        Figure("resume", f"re-run → first new request, {run.rows_before:,} rows done",
               fmt_s(run.first_request_s) if run.first_request_s is not None else f"> {first_timeout(big):.0f} s",
               goal=f"≤ {GOAL_RESUME_S:g} s", issue="26.7 s (74,227 done)", machine=run.machine(),
               passed=within and not problem, note=problem,
               data={"rows_done": run.rows_before, "first_request_s": run.first_request_s, "run": run.label}),
        rss_figure("resume", f"peak RSS, re-run with {run.rows_before:,} rows done, {args.hold:g} s of sending",
                   run, "800 MB (74,227 done)", problem, big),
    ]


def check_throughput(ctx: Context) -> list[Figure]:
    args = ctx.args
    rows = args.throughput_rows
    env, source = aiohttp_env()
    if env is None:
        raise CheckFailed(source)
    print(f"    minimal client: {source}", file=sys.stderr, flush=True)
    path = ctx.input(rows)
    ctx.start_stub()
    figures = []
    for concurrency in args.concurrency:
        by: dict[str, list[Run]] = {"minimal": [], "tokenmill": []}
        problems = []
        for round_ in range(args.rounds):
            order = ["minimal", "tokenmill"] if round_ % 2 == 0 else ["tokenmill", "minimal"]
            for who in order:
                out = ctx.fresh("throughput", f"{who}-c{concurrency}-r{round_}")
                if who == "minimal":
                    out.mkdir()
                    cmd = [sys.executable, str(MINIMAL), str(path), str(out / "results.jsonl"), "--url", ctx.stub.v1,
                           "--concurrency", str(concurrency)]
                else:
                    cmd = ctx.job(path, out, concurrency)
                run = measure(ctx, f"throughput c={concurrency} round {round_ + 1} {who}", cmd, out / "results.jsonl",
                              timeout=run_timeout(rows), env=env if who == "minimal" else None)
                by[who].append(run)
                if run.note or run.exit_code != 0 or run.rows_after != rows:
                    problems.append(f"{who} round {round_ + 1}: exit {run.exit_code}, {run.rows_after:,}/{rows:,} rows"
                                    + (f" ({run.note})" if run.note else ""))
                if not args.keep_tmp:
                    shutil.rmtree(out, ignore_errors=True)
        med = {who: statistics.median(r.req_s for r in runs) for who, runs in by.items()}
        cpu = {who: statistics.median(r.cpu_pct for r in runs) for who, runs in by.items()}
        stub = {who: statistics.median(r.stub_pct for r in runs) for who, runs in by.items()}
        ratio = med["tokenmill"] / med["minimal"] if med["minimal"] else 0.0
        rounds = {who: [round(r.req_s) for r in runs] for who, runs in by.items()}
        others = max(r.others_cores for runs in by.values() for r in runs)
        steady = {who: statistics.median(r.stub_requests / r.stub_span_s if r.stub_span_s else 0.0 for r in runs)
                  for who, runs in by.items()}  # first POST → last POST at the stub: start-up left out
        figures.append(Figure(
            "throughput", f"c={concurrency}: tokenmill / minimal, {rows:,} rows",
            f"{ratio:.2f}× · tokenmill {med['tokenmill']:,.0f} req/s (rounds {rounds['tokenmill']}, CPU "
            f"{cpu['tokenmill']:.0f}%, stub {stub['tokenmill']:.0f}%) · minimal {med['minimal']:,.0f} req/s "
            f"(rounds {rounds['minimal']}, CPU {cpu['minimal']:.0f}%, stub {stub['minimal']:.0f}%)",
            goal=f"≥ {GOAL_RATIO:g}×", issue="~420 req/s at c=64 (1M rows)" if concurrency == 64 else "",
            machine=f"others ≤ {others:.2f} cores · load {by['tokenmill'][0].load1:.2f}",
            passed=ratio >= GOAL_RATIO and not problems, note="; ".join(problems),
            data={"concurrency": concurrency, "ratio": ratio, "median_req_s": med, "rounds_req_s": rounds,
                  "cpu_pct": cpu, "stub_pct": stub, "steady_req_s": steady, "client": source}))
    return figures


def exactly_once(paths: list[Path], rows: int) -> dict[str, Any]:
    """Stream the output files; one byte per input row counts its rows (1 MB at a million rows)."""
    counts = bytearray(rows)
    strays = malformed = 0
    per_file: dict[str, int] = {}
    for path in paths:
        n = 0
        if path.exists():
            with path.open("rb") as f:
                for line in f:
                    n += 1
                    try:
                        custom_id = json.loads(line)["custom_id"]
                    except (ValueError, KeyError, TypeError):
                        malformed += 1
                        continue
                    number = custom_id[4:] if isinstance(custom_id, str) and custom_id.startswith("req-") else ""
                    if number.isdigit() and str(int(number)) == number and int(number) < rows:
                        i = int(number)
                        if counts[i] < 255:
                            counts[i] += 1
                    else:
                        strays += 1
        per_file[path.name] = n
    import numpy as np

    array = np.frombuffer(counts, dtype=np.uint8)
    missing, repeated = np.flatnonzero(array == 0), np.flatnonzero(array > 1)
    return {"rows_per_file": per_file, "missing": int(missing.size), "duplicated": int(repeated.size),
            "strays": strays, "malformed": malformed,
            "examples": [f"req-{i} missing" for i in missing[:3]] + [f"req-{i} ×{array[i]}" for i in repeated[:3]]}


def check_kill(ctx: Context) -> list[Figure]:
    args = ctx.args
    rows = args.rows
    ctx.start_stub()
    path, out = ctx.input(rows), ctx.fresh("kill", "out")
    results = out / "results.jsonl"
    rng = random.Random(args.seed)
    low, high = max(1, rows // 50), rows - max(1, rows // 50)
    width = (high - low) / args.kills
    points = [int(low + width * k + rng.random() * width) for k in range(args.kills)]
    runs = []
    for k, point in enumerate(points):
        run = measure(ctx, f"kill {k + 1}/{args.kills} at {point:,} rows", ctx.job(path, out), results,
                      stop=at_rows(point), timeout=run_timeout(rows), first_within=first_timeout(rows))
        if run.exit_code != -signal.SIGKILL:
            raise CheckFailed(f"run {k + 1} ended (exit {run.exit_code}, {run.rows_after:,} rows) before its "
                              f"kill at {point:,}: {run.note}")
        runs.append(run)
    final = measure(ctx, "kill: final run to the end", ctx.job(path, out), results, timeout=run_timeout(rows),
                    first_within=first_timeout(rows))
    runs.append(final)
    start = time.monotonic()
    tally = exactly_once([results, out / "errors.jsonl"], rows)
    tally["check_s"] = time.monotonic() - start
    problems = [p for p in (final.note, job_ok(final, 0)) if p]
    for key in ("missing", "duplicated", "strays", "malformed"):
        if tally[key]:
            problems.append(f"{tally[key]:,} {key}")
    problems += tally["examples"]
    sent = sum(r.stub_requests for r in runs)
    at_kills = [r.rows_after for r in runs[:-1]]
    files = tally["rows_per_file"]
    return [Figure(
        "kill", f"{args.kills}× SIGKILL over {rows_label(rows)}, then to the end",
        f"killed at {', '.join(f'{n:,}' for n in at_kills)} rows; results {files.get('results.jsonl', 0):,} + errors "
        f"{files.get('errors.jsonl', 0):,}; missing {tally['missing']}, duplicated {tally['duplicated']}, other rows "
        f"{tally['strays'] + tally['malformed']}; {sent - rows:,} requests sent twice (in flight at a kill); "
        f"checked in {tally['check_s']:.1f} s",
        goal="every row exactly once", machine=f"others ≤ {max(r.others_cores for r in runs):.2f} cores",
        passed=not problems, note="; ".join(problems),
        data={"points": points, "rows_at_kills": at_kills, "requests_sent": sent, **tally})]


CHECKS: dict[str, Callable[[Context], list[Figure]]] = {
    "generate": check_generate,
    "first-request": check_first_request,
    "memory": check_memory,
    "resume": check_resume,
    "throughput": check_throughput,
    "kill": check_kill,
}


def run_check(name: str, ctx: Context) -> dict[str, Any]:
    """One check, isolated: a crash in it is its FAIL, and its children die before the next starts."""
    start, first_run = time.monotonic(), len(ctx.runs)
    try:
        figures = CHECKS[name](ctx)
    except CheckFailed as exc:
        figures = [Figure(name, "setup", "-", passed=False, note=str(exc))]
    except Exception as exc:  # a bug in the check or a job that misbehaves in a new way: report, go on
        figures = [Figure(name, "crashed", "-", passed=False, note=f"{type(exc).__name__}: {exc}")]
    finally:
        ctx.children.kill_all()
        ctx.stub = None
        if not ctx.args.keep_tmp:
            shutil.rmtree(ctx.rundir / name, ignore_errors=True)
    return {"passed": all(f.passed is not False for f in figures), "seconds": time.monotonic() - start,
            "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "commit": git_commit(),
            "figures": [asdict(f) for f in figures], "runs": [r.to_json() for r in ctx.runs[first_run:]]}


def git_commit() -> str:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


# ---- report -----------------------------------------------------------------------------------------


def print_table(checks: dict[str, dict[str, Any]], ran: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tokenmill run --endpoint: the job layer at a million rows", show_lines=False)
    for column in ("check", "figure", "measured", "goal", "issue (old code)", "machine", "result"):
        table.add_column(column, overflow="fold")
    for name in ran:
        for f in checks[name]["figures"]:
            result = {True: "[green]PASS[/]", False: "[red]FAIL[/]", None: ""}[f["passed"]]
            value = f["value"] + (f"\n[red]{f['note']}[/]" if f["note"] else "")
            table.add_row(f["check"], f["what"], value, f["goal"], f["issue"], f["machine"], result)
    Console(width=200).print(table)


def plot(report: dict[str, Any], path: Path) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    checks = report["checks"]
    fig, (ax_tp, ax_rss, ax_first) = plt.subplots(1, 3, figsize=(17, 5.2))
    tp = [f["data"] for f in checks.get("throughput", {}).get("figures", []) if "ratio" in f["data"]]
    if tp:
        x = range(len(tp))
        for offset, who, color in ((-0.2, "minimal", "tab:gray"), (0.2, "tokenmill", "tab:blue")):
            ax_tp.bar([i + offset for i in x], [d["median_req_s"][who] for d in tp], 0.4, color=color,
                      label=f"{who} (median)")
            for i, d in zip(x, tp, strict=True):
                ax_tp.plot([i + offset] * len(d["rounds_req_s"][who]), d["rounds_req_s"][who], "k.", ms=5)
        for i, d in zip(x, tp, strict=True):
            top = max(d["median_req_s"].values())
            ax_tp.annotate(f"{d['ratio']:.2f}×", (i, top * 1.04), ha="center", fontsize=10)
        ax_tp.set_xticks(list(x), [f"concurrency {d['concurrency']}" for d in tp])
        ax_tp.set_ylim(0, 1.45 * max(max(d["median_req_s"].values()) for d in tp))
        ax_tp.axhline(ISSUE["req_s"], color="tab:red", ls=":", lw=1,
                      label=f"issue: old code, c=64 ({ISSUE['req_s']} req/s)")
        ax_tp.legend(fontsize=8, loc="upper right")
    else:
        ax_tp.text(0.5, 0.5, "throughput not run", ha="center", transform=ax_tp.transAxes)
    ax_tp.set_ylabel("requests/s (rows / wall)")
    ax_tp.set_title(f"throughput vs the minimal aiohttp client (goal ≥ {GOAL_RATIO}×), dots: rounds", fontsize=10)

    rss = [(f["what"].removeprefix("peak RSS, "), f["data"]["peak_mb"]) for name in ("memory", "resume")
           for f in checks.get(name, {}).get("figures", []) if f["data"].get("peak_mb") is not None]
    if rss:
        ax_rss.barh([textwrap.fill(label, 30) for label, _ in rss], [v for _, v in rss], color="tab:green")
        for y, (_, v) in enumerate(rss):
            ax_rss.annotate(f" {v:.0f}", (v, y), va="center", fontsize=8)
        ax_rss.axvline(GOAL_RSS_MB, color="k", ls="--", lw=1, label=f"goal < {GOAL_RSS_MB:g} MB")
        ax_rss.axvspan(*ISSUE["rss_mb_1m"], color="tab:red", alpha=0.15, label="issue: 1M rows, old code (560–610)")
        ax_rss.axvline(ISSUE["resume_rss_mb"], color="tab:purple", ls=":", lw=1, label="issue: resume, old code (800)")
        ax_rss.invert_yaxis()
        ax_rss.legend(fontsize=8, loc="lower right")
        ax_rss.tick_params(axis="y", labelsize=7)
    else:
        ax_rss.text(0.5, 0.5, "memory not run", ha="center", transform=ax_rss.transAxes)
    ax_rss.set_xlabel("peak RSS, MB")
    ax_rss.set_title("memory", fontsize=10)

    first = [(f"{rows_label(f['data']['rows'])}", f["data"]["first_request_s"], GOAL_FIRST_S)
             for f in checks.get("first-request", {}).get("figures", []) if f["data"].get("first_request_s")]
    first += [(f"resume, {f['data']['rows_done']:,} done", f["data"]["first_request_s"], GOAL_RESUME_S)
              for f in checks.get("resume", {}).get("figures", []) if f["data"].get("first_request_s")]
    if first:
        ax_first.barh([label for label, _, _ in first], [v for _, v, _ in first], color="tab:orange")
        for y, (_, v, goal) in enumerate(first):
            ax_first.annotate(f" {v:.2f} s (goal ≤ {goal:g})", (v, y), va="center", fontsize=8,
                              bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        ax_first.axvline(GOAL_FIRST_S, color="k", ls="--", lw=1,
                         label=f"goal ≤ {GOAL_FIRST_S:g} s (resume ≤ {GOAL_RESUME_S:g} s)")
        ax_first.axvline(GOAL_RESUME_S, color="k", ls="--", lw=1)
        ax_first.axvline(ISSUE["first_request_s"], color="tab:red", ls=":", lw=1,
                         label="issue: 1M rows, old code (30 s)")
        ax_first.axvline(ISSUE["resume_first_s"], color="tab:purple", ls=":", lw=1,
                         label="issue: resume, 74,227 done (26.7 s)")
        ax_first.set_xlim(0, max(32, 1.15 * max(v for _, v, _ in first)))
        ax_first.invert_yaxis()
        ax_first.legend(fontsize=8, loc="lower right")
    else:
        ax_first.text(0.5, 0.5, "first-request / resume not run", ha="center", transform=ax_first.transAxes)
    ax_first.set_xlabel("seconds from start to the first request")
    ax_first.set_title("start", fontsize=10)
    fig.suptitle(textwrap.fill(f"{report['command']} · {report['machine']['cpus']} CPUs · {report['when']}", 180),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def concurrency_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Checks: " + ", ".join(CHECKS) + " (see the module docstring).")
    parser.add_argument("--rows", type=int, default=1_000_000, help="the big file (default 1,000,000)")
    parser.add_argument("--rows-10m", type=int, default=10_000_000,
                        help="the bigger file for the memory and first-request checks (default 10,000,000; 0 skips)")
    parser.add_argument("--throughput-rows", type=int, default=30_000, help="rows per throughput run (default 30,000)")
    parser.add_argument("--concurrency", type=concurrency_list, default=[64, 256], help="throughput: default 64,256")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds of each client (default 2)")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs in the kill check (default 5)")
    parser.add_argument("--resume-done", type=int, default=0,
                        help="rows done before the resume's kill (default: --rows of the 10M file, or 99%% of --rows)")
    parser.add_argument("--hold", type=float, default=10.0,
                        help="seconds a first-request / resume / --strict run goes on after its first request")
    parser.add_argument("--memory-seconds", type=float, default=60.0,
                        help="seconds the 10M-row memory run sends before its SIGINT (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="of the kill points")
    parser.add_argument("--only", choices=list(CHECKS), action="append", help="run this check (repeatable)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR,
                        help="inputs (cached) and run outputs (default benchmarks/.work)")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the run outputs and logs in the workdir")
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS,
                        help="the JSON report; the chart goes beside it as .png "
                             "(default benchmarks/results/million_rows.json)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # SIGTERM → the finally blocks kill the children

    workdir = args.workdir.resolve()
    (workdir / "inputs").mkdir(parents=True, exist_ok=True)
    rundir = workdir / f"run-{os.getpid()}"
    rundir.mkdir(parents=True, exist_ok=True)
    ctx = Context(args, workdir, rundir, Children())
    command = shlex.join(["python", "benchmarks/million_rows.py", *sys.argv[1:]])
    names = list(dict.fromkeys(args.only)) if args.only else list(CHECKS)
    print(f"{command}\n  {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, workdir {workdir}", file=sys.stderr)
    checks: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            print(f"  running {name} ...", file=sys.stderr, flush=True)
            checks[name] = run_check(name, ctx)
            print(f"  {'PASS' if checks[name]['passed'] else 'FAIL'} {name} [{checks[name]['seconds']:.0f} s]",
                  file=sys.stderr, flush=True)
    finally:
        ctx.children.kill_all()
        if args.keep_tmp:
            print(f"kept {rundir}", file=sys.stderr)
        else:
            shutil.rmtree(rundir, ignore_errors=True)

    print_table(checks, names)
    sizes = {"rows": args.rows, "rows_10m": args.rows_10m, "throughput_rows": args.throughput_rows,
             "concurrency": args.concurrency, "line_bytes": LINE_BYTES}
    previous: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads(args.results.read_text())
        if old.get("sizes") == sizes:  # the other checks' figures of the last run of the same sizes stay
            previous = old.get("checks", {})
    report = {
        "command": command, "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "sizes": sizes, "goals": {"first_request_s": GOAL_FIRST_S, "resume_first_s": GOAL_RESUME_S,
                                  "rss_mb": GOAL_RSS_MB, "throughput_ratio": GOAL_RATIO},
        "issue": ISSUE, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                    "platform": platform.platform(), "commit": git_commit()},
        "checks": {**previous, **checks},
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(report, indent=1) + "\n")
    png = args.results.with_suffix(".png")
    plot(report, png)
    failed = [name for name in names if not checks[name]["passed"]]
    print(f"{len(names) - len(failed)}/{len(names)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"\njson: {args.results}\npng: {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
