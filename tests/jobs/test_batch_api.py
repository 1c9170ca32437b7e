"""The Batch API backend (`tokenmill run --endpoint URL --batch-api`) end to end against a real
`tokenmill serve` on 127.0.0.1 (one for the module, over the embedded model): parts within the
limits, one url per part, every row exactly once; a real `kill -9`, and a state file as a kill
between creating a batch and recording its id leaves it, each resumed with no part submitted
twice; a merge cut short; a stop with batches running. Plus the part splitter, the row coding
and the flags, without a server."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest

from tests import serve_helpers
from tests.serve_helpers import Running
from tokenmill.cli import main
from tokenmill.engine.llm import LLM
from tokenmill.jobs.backends.base import ResultSink, StopFlag
from tokenmill.jobs.backends.batch_api import (
    SUBMITTED,
    UPLOADED,
    UPLOADING,
    BatchApiBackend,
    BatchApiSpec,
    BatchState,
    PartRecord,
    hand_row,
    job_key,
    line_ranges,
    part_metadata,
)
from tokenmill.jobs.backends.batch_parts import OpenPart, PartSplitter, batch_line
from tokenmill.jobs.backends.build import build_backend
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobFailed
from tokenmill.jobs.input.reader import read_input
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.journal.rows import is_transient
from tokenmill.jobs.runner import run_job

from .conftest import assert_exactly_once, read_jsonl, write_jsonl
from .conftest import batch_line as input_line

MODEL = "smollm-test"
FLAGS = ["--max-tokens", "3", "--temperature", "0", "--model", MODEL, "--no-progress", "--poll-interval", "0.2"]

pytestmark = pytest.mark.usefixtures("no_proxies")  # the servers are on 127.0.0.1


@pytest.fixture(scope="module")
def server(smollm_weights: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    llm = LLM(weights=smollm_weights, max_num_seqs=16, max_model_len=512)
    with serve_helpers.serving(llm, tmp_path_factory.mktemp("serve-state"), MODEL) as running:
        yield running


def reviews(path: Path, rows: int) -> Path:
    path.write_text("".join(f"Review {i}: the kettle works.\n" for i in range(1, rows + 1)))
    return path


def server_batches(server: Running, key: str) -> list[dict[str, Any]]:
    """Every batch on the server tagged with this job's key, paging as a client must."""
    found, after = [], None
    while True:
        page = httpx.get(f"{server.v1}/batches", params={"limit": 2, **({"after": after} if after else {})}).json()
        found += [b for b in page["data"] if (b.get("metadata") or {}).get("tokenmill_job") == key]
        if not page["has_more"]:
            return found
        after = page["last_id"]


def state_of(out: Path) -> dict[str, Any]:
    return json.loads((out / "backend.json").read_text())


def run_cli(*args: str | Path) -> int:
    return main(["run", *map(str, args)])


# ---- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_job_through_the_batch_api_in_parts_gives_every_row_once(
    server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [input_line(f"chat-{i}", f"Say a colour, {i}.") for i in range(10)]
    rows += [input_line(f"plain-{i}", f"Once upon a time {i}", url="/v1/completions") for i in range(2)]
    rows.append(input_line("huge", "word " * 500))  # over --max-bytes-per-part on its own
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    code = run_cli(path, "-o", out, "--endpoint", server.v1, "--batch-api", "--max-requests-per-part", "5",
                   "--max-bytes-per-part", "2000", *FLAGS)
    stderr = capsys.readouterr().err
    assert code == 1, stderr  # the huge line failed; every other one has its result
    assert_exactly_once(out, len(rows))
    results, errors = read_jsonl(out / "results.jsonl"), read_jsonl(out / "errors.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(r["custom_id"] for r in rows[:-1])
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("huge", "invalid_input")]  # refused up front
    assert "--max-bytes-per-part" in errors[0]["error"]["message"]
    assert all(r["response"]["body"]["model"] == MODEL for r in results)

    state = state_of(out)
    assert [p["status"] for p in state["parts"]] == ["merged"] * 3
    batches = server_batches(server, state["job_key"])
    assert sorted(b["metadata"]["tokenmill_part"] for b in batches) == ["1", "2", "3"]  # 5 + 5 chat, 2 completions
    assert sorted((b["endpoint"], b["request_counts"]["total"]) for b in batches) == [
        ("/v1/chat/completions", 5), ("/v1/chat/completions", 5), ("/v1/completions", 2)]
    assert all(b["status"] == "completed" for b in batches)
    assert stderr.count("→ batch batch_") == 3 and "every part merged (3 in all)" in stderr

    assert run_cli(path, "-o", out, "--endpoint", server.v1, "--batch-api", "--max-requests-per-part", "5",
                   "--max-bytes-per-part", "2000", *FLAGS) == 1  # nothing left to run: no new batch
    assert len(server_batches(server, state["job_key"])) == 3
    assert_exactly_once(out, len(rows))


@pytest.mark.slow
def test_kill_9_while_submitting_then_rerun_submits_no_part_twice(server: Running, tmp_path: Path) -> None:
    path, out = reviews(tmp_path / "reviews.txt", 12), tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--endpoint", server.v1,
           "--batch-api", "--max-requests-per-part", "3", *FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (out / "backend.json").exists() or not any(p["batch_id"] for p in state_of(out)["parts"]):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "no batch submitted within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    before = state_of(out)
    assert any(p["status"] != "merged" for p in before["parts"]), "the kill came after the job was over"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr
    assert_exactly_once(out, 12)
    assert len(read_jsonl(out / "results.jsonl")) == 12
    parts = [b["metadata"]["tokenmill_part"] for b in server_batches(server, before["job_key"])]
    assert sorted(parts, key=int) == ["1", "2", "3", "4"]  # each part's batch created once, whatever the kill hit
    assert [p["status"] for p in state_of(out)["parts"]] == ["merged"] * 4


@pytest.mark.slow
def test_a_stop_leaves_the_batches_running_and_a_rerun_collects_them(
    server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = reviews(tmp_path / "reviews.txt", 8), tmp_path / "out"
    config = JobConfig(input=path, output=out, options=DocumentOptions(max_tokens=3, temperature=0, model=MODEL),
                       progress=False)
    spec = BatchApiSpec(server.v1, poll_s=0.2, max_requests_per_part=1)  # 8 parts: the stop lands mid-way
    stop, outcomes = StopFlag(), []
    worker = threading.Thread(target=lambda: outcomes.append(run_job(config, build_backend(spec), stop=stop)))
    worker.start()
    deadline = time.monotonic() + 60
    while not (out / "backend.json").exists() or not any(p["batch_id"] for p in state_of(out)["parts"]):
        assert worker.is_alive() and time.monotonic() < deadline, "no batch submitted"
        time.sleep(0.005)
    stop.request()  # what Ctrl-C does
    worker.join(timeout=10)
    assert not worker.is_alive() and outcomes[0].interrupted
    assert "keep running on the server" in capsys.readouterr().err
    stopped = state_of(out)
    assert any(p["status"] == "submitted" for p in stopped["parts"]) and len(stopped["parts"]) < 8

    assert run_job(config, build_backend(spec)).status == "done"
    assert_exactly_once(out, 8)
    parts = sorted(int(b["metadata"]["tokenmill_part"]) for b in server_batches(server, stopped["job_key"]))
    assert parts == list(range(1, 9))


def submit_by_hand(server: Running, state: BatchState, number: int, requests: list[BatchRequest]) -> tuple[str, str]:
    """What the backend does for a part, done here: upload its lines, create its batch (the
    state file is left for the caller to write, as a kill would leave it). (file id, batch id)"""
    data = b"".join(batch_line(r) for r in requests)
    file = httpx.post(f"{server.v1}/files", files={"file": ("part.jsonl", io.BytesIO(data))},
                      data={"purpose": "batch"}).json()
    batch = httpx.post(f"{server.v1}/batches", json={
        "input_file_id": file["id"], "endpoint": requests[0].url, "completion_window": "24h",
        "metadata": part_metadata(state.key, number)}).json()
    return file["id"], batch["id"]


def job_requests(path: Path) -> list[BatchRequest]:
    """The requests `tokenmill run` makes of `path` with FLAGS."""
    spec = read_input(path, DocumentOptions(max_tokens=3, temperature=0, model=MODEL))
    return list(spec.requests(spec.entries))


@pytest.mark.slow
def test_a_batch_created_but_not_recorded_is_adopted_not_submitted_again(
    server: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = reviews(tmp_path / "reviews.txt", 12), tmp_path / "out"
    out.mkdir()
    requests = job_requests(path)
    state = BatchState.open(out / "backend.json", server.url)
    # Part 1 was submitted and recorded; part 2's batch was created, the kill came before its id
    # was written down; part 3 was recorded and never uploaded.
    file_1, batch_1 = submit_by_hand(server, state, 1, requests[0:4])
    state.record(PartRecord(1, requests[0].url, [1, 2, 3, 4], time.time(), SUBMITTED, file_1, batch_1))
    file_2, batch_2 = submit_by_hand(server, state, 2, requests[4:8])
    state.record(PartRecord(2, requests[0].url, [5, 6, 7, 8], time.time(), UPLOADED, file_2))
    state.record(PartRecord(3, requests[0].url, [9, 10, 11, 12], time.time(), UPLOADING))

    code = run_cli(path, "-o", out, "--endpoint", server.v1, "--batch-api", "--max-requests-per-part", "4", *FLAGS)
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert f"part 1: waiting for batch {batch_1}" in stderr and f"part 2: adopted batch {batch_2}" in stderr
    assert_exactly_once(out, 12)
    batches = {b["metadata"]["tokenmill_part"]: b["id"] for b in server_batches(server, state.key)}
    assert len(server_batches(server, state.key)) == 3 and batches["1"] == batch_1 and batches["2"] == batch_2
    assert [p["batch_id"] for p in state_of(out)["parts"]] == [batch_1, batch_2, batches["3"]]


class Rows:
    """A `RowWriter` that keeps the rows (the sink's own code, no file under it)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def write(self, row: dict[str, Any], entry: Any = None) -> None:
        self.rows.append(row)


@pytest.mark.slow
def test_a_merge_cut_short_is_finished_by_the_next_run_not_repeated(server: Running, tmp_path: Path) -> None:
    requests = job_requests(reviews(tmp_path / "reviews.txt", 4))
    state = BatchState.open(tmp_path / "backend.json", server.url)
    file_id, batch_id = submit_by_hand(server, state, 1, requests)
    state.record(PartRecord(1, requests[0].url, [1, 2, 3, 4], time.time(), SUBMITTED, file_id, batch_id))
    # The last run handed rows 1 and 2 over before it was killed: the runner gives this one 3 and 4.
    backend = BatchApiBackend(BatchApiSpec(server.v1, poll_s=0.1))
    backend.keep_state(tmp_path / "backend.json")
    results, errors = Rows(), Rows()
    backend.run(iter(requests[2:]), ResultSink(results, errors, None), StopFlag())
    assert [r["custom_id"] for r in results.rows] == ["line-3", "line-4"] and not errors.rows
    assert len(server_batches(server, state.key)) == 1
    assert state_of(tmp_path)["parts"][0]["status"] == "merged"


# ---- the network failing the calls ---------------------------------------------------------------------
class Proxy:
    """A TCP proxy on 127.0.0.1 in front of a server, failing the next request that starts with a
    marker (`fail`) as a network does: "cut" drops its connection once `CUT_AFTER` bytes of it went
    through (mid-upload, for a part's file), "hold" takes it whole and never answers."""

    CUT_AFTER = 600  # past the headers, short of the body

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.faults: list[tuple[bytes, str]] = []  # (marker, how), each for one request
        self.done: list[str] = []  # the faults that happened
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def v1(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    def fail(self, marker: bytes, how: str) -> None:
        with self._lock:
            self.faults.append((marker, how))

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection((self.upstream.hostname, self.upstream.port))
            threading.Thread(target=self._to_server, args=(client, server), daemon=True).start()
            threading.Thread(target=_pipe, args=(server, client), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket) -> None:
        with client, server:
            left: int | None = None  # bytes to pass on before the cut
            while chunk := _recv(client):
                how = self._fault_for(chunk) if left is None else None
                if how == "hold":
                    while _recv(client):
                        pass
                    return
                if how == "cut":
                    left = self.CUT_AFTER
                if left is not None:
                    server.sendall(chunk[:left])
                    left -= len(chunk)
                    if left <= 0:
                        return
                else:
                    server.sendall(chunk)

    def _fault_for(self, chunk: bytes) -> str | None:
        with self._lock:
            for i, (marker, how) in enumerate(self.faults):
                if chunk.startswith(marker):
                    del self.faults[i]
                    self.done.append(how)
                    return how
        return None


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := _recv(src):
            dst.sendall(chunk)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_RDWR)


@pytest.fixture()
def proxy(server: Running) -> Iterator[Proxy]:
    running = Proxy(server.url)
    yield running
    running.close()


def retried_error(stderr: str, what: str) -> type[BaseException]:
    """The exception a call failed with, as its retry notice names it."""
    found = re.search(rf"{what}: (\w+)\b.*; trying again in", stderr)
    assert found, stderr
    return getattr(aiohttp, found[1], None) or getattr(builtins, found[1])


@pytest.mark.slow
@pytest.mark.parametrize(("how", "flags", "error"), [
    ("cut", [], aiohttp.ClientConnectionError),  # the connection lost mid-upload
    ("hold", ["--timeout", "2"], TimeoutError),  # no answer within the attempt's --timeout
])
def test_an_upload_the_network_fails_is_sent_again_and_the_job_completes(
    server: Running, proxy: Proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, flags: list[str],
    error: type[BaseException],
) -> None:
    path, out = reviews(tmp_path / "reviews.txt", 8), tmp_path / "out"
    proxy.fail(b"POST /v1/files", how)
    code = run_cli(path, "-o", out, "--endpoint", proxy.v1, "--batch-api", "--max-requests-per-part", "4", *flags,
                   *FLAGS)
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert proxy.done == [how]
    assert issubclass(retried_error(stderr, r"uploading tm-\w+-part-00001\.jsonl"), error), stderr
    assert_exactly_once(out, 8)
    assert len(read_jsonl(out / "results.jsonl")) == 8
    parts = [b["metadata"]["tokenmill_part"] for b in server_batches(server, state_of(out)["job_key"])]
    assert sorted(parts) == ["1", "2"]  # the part sent again made one batch


@pytest.mark.slow
def test_a_second_stop_aborts_the_upload_in_flight_and_a_rerun_submits_the_part(
    server: Running, proxy: Proxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = reviews(tmp_path / "reviews.txt", 4), tmp_path / "out"
    config = JobConfig(input=path, output=out, options=DocumentOptions(max_tokens=3, temperature=0, model=MODEL),
                       progress=False)
    spec = BatchApiSpec(proxy.v1, poll_s=0.2)  # an attempt may take 600 s
    proxy.fail(b"POST /v1/files", "hold")
    stop, outcomes = StopFlag(), []
    worker = threading.Thread(target=lambda: outcomes.append(run_job(config, build_backend(spec), stop=stop)))
    worker.start()
    deadline = time.monotonic() + 30
    while not proxy.done:
        assert worker.is_alive() and time.monotonic() < deadline, "no upload started"
        time.sleep(0.01)
    stop.request()
    time.sleep(0.3)
    assert worker.is_alive()  # the first stop lets the call in flight finish
    stop.request()
    worker.join(timeout=5)
    assert not worker.is_alive() and outcomes[0].interrupted
    assert "stopped while being submitted" in capsys.readouterr().err
    assert [p["status"] for p in state_of(out)["parts"]] == ["uploading"]

    assert run_job(config, build_backend(spec)).status == "done"
    assert_exactly_once(out, 4)
    assert [p["status"] for p in state_of(out)["parts"]] == ["merged"]


class Counted:
    """A `RowWriter` that counts the rows and keeps none."""

    def __init__(self) -> None:
        self.count = 0

    def write(self, row: dict[str, Any], entry: Any = None) -> None:
        self.count += 1


@dataclass
class Provider:
    url: str  # its /v1
    seen: list[str]  # "METHOD target" of each request, as its request line has it (a proxy's: the whole URL)
    created: list[dict[str, Any]]  # the batches it created


@contextlib.contextmanager
def provider(rows: list[bytes], pause_s: float = 0.0,
             replies: dict[str, list[tuple[int, bytes]]] | None = None) -> Iterator[Provider]:
    """A provider's Batch API as far as one part needs it: it takes the upload, creates the batch,
    lists none, says the batch completed, and sends its output file (`rows`) 64 KiB at a time,
    `pause_s` apart. `replies`, by "METHOD /path": the answers (status, body) its next requests
    get instead, one each."""
    output = b"".join(rows)
    found = Provider("", [], [])
    queued = {key: list(answers) for key, answers in (replies or {}).items()}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self._queued("POST"):
                return
            if urlsplit(self.path).path == "/v1/files":
                self._json({"id": "file-in"})
                return
            found.created.append({"id": "batch_1", "status": "validating", **json.loads(body)})
            self._json(found.created[-1])

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if self._queued("GET"):
                return
            if path == "/v1/batches":
                self._json({"object": "list", "data": [], "has_more": False})
            elif path != "/v1/files/file-out/content":
                self._json({"id": "batch_1", "status": "completed", "output_file_id": "file-out"})
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(len(output)))
                self.end_headers()
                for start in range(0, len(output), 1 << 16):
                    self.wfile.write(output[start:start + (1 << 16)])
                    self.wfile.flush()
                    time.sleep(pause_s)

        def _queued(self, method: str) -> bool:
            found.seen.append(f"{method} {self.path}")
            answers = queued.get(f"{method} {urlsplit(self.path).path}")
            if not answers:
                return False
            status, raw = answers.pop(0)
            self._send(status, raw)
            return True

        def _json(self, obj: dict[str, Any]) -> None:
            self._send(200, json.dumps(obj).encode())

        def _send(self, status: int, raw: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    found.url = f"http://127.0.0.1:{http.server_address[1]}/v1"
    try:
        yield found
    finally:
        http.shutdown()
        http.server_close()


def answers(requests: list[BatchRequest], text: str = "hi") -> list[bytes]:
    """The output file's rows: a completion for each request."""
    body = {"choices": [{"message": {"content": text}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    return [json.dumps({"custom_id": r.custom_id, "response": {"status_code": 200, "body": body}}).encode() + b"\n"
            for r in requests]


def run_backend(spec: BatchApiSpec, requests: list[BatchRequest], state: Path) -> tuple[Counted, Counted]:
    """The backend run over `requests` with its state file at `state`: (results, errors) counted."""
    backend = BatchApiBackend(spec)
    backend.keep_state(state)
    results, errors = Counted(), Counted()
    backend.run(iter(requests), ResultSink(results, errors, None), StopFlag())
    return results, errors


@pytest.mark.slow
def test_a_big_output_file_streams_to_disk_for_longer_than_the_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [request(n) for n in range(1, 2001)]
    rows = answers(requests, "x" * 4000)
    size = sum(map(len, rows))  # 8 MB, sent in 1.3 s: a timeout of 0.5 s bounds silence, not the download
    with provider(rows, pause_s=0.01) as api:
        tracemalloc.start()
        try:
            results, errors = run_backend(BatchApiSpec(api.url, poll_s=0.05, timeout_s=0.5, retry_for_s=2), requests,
                                          tmp_path / "backend.json")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert (results.count, errors.count) == (2000, 0)
    assert "trying again" not in capsys.readouterr().err
    assert peak < size / 4, f"{peak:,} bytes held at once for an {size:,}-byte file"


def test_a_4xx_ends_the_job_at_once_with_exit_3_naming_the_call(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused = json.dumps({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})
    path, out = reviews(tmp_path / "reviews.txt", 3), tmp_path / "out"
    with provider([], replies={"POST /v1/files": [(401, refused.encode())]}) as api:
        code = run_cli(path, "-o", out, "--endpoint", api.url, "--batch-api", *FLAGS)
    stderr = capsys.readouterr().err
    assert code == 3, stderr
    assert "tokenmill run: POST /v1/files: HTTP 401: Incorrect API key provided" in stderr
    assert "trying again" not in stderr and [s.split()[0] for s in api.seen] == ["POST"]  # not retried
    assert [p["status"] for p in state_of(out)["parts"]] == ["uploading"]  # a re-run submits it


def test_a_5xx_creating_a_batch_is_retried_once_none_is_found_and_made_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [request(n) for n in range(1, 4)]
    with provider(answers(requests), replies={"POST /v1/batches": [(503, b"upstream busy")]}) as api:
        results, errors = run_backend(BatchApiSpec(api.url, poll_s=0.05), requests, tmp_path / "backend.json")
    assert (results.count, errors.count) == (3, 0)
    assert "creating a batch: HTTP 503: upstream busy; trying again in" in capsys.readouterr().err
    # Before the retry it asked whether the failed try had made the batch after all.
    assert api.seen[:4] == ["POST /v1/files", "POST /v1/batches", "GET /v1/batches?limit=100", "POST /v1/batches"]
    assert len(api.created) == 1 and api.created[0]["metadata"]["tokenmill_part"] == "1"


def test_the_calls_go_through_the_environment_s_proxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [request(n) for n in range(1, 3)]
    with provider(answers(requests)) as api:
        monkeypatch.setenv("HTTP_PROXY", api.url.removesuffix("/v1"))
        # No such host: only through the proxy is there an answer.
        spec = BatchApiSpec("http://batch.tokenmill-test.invalid/v1", poll_s=0.05, retry_for_s=0)
        results, errors = run_backend(spec, requests, tmp_path / "backend.json")
    assert (results.count, errors.count) == (2, 0)
    assert api.seen[0] == "POST http://batch.tokenmill-test.invalid/v1/files"
    assert all(s.split()[1].startswith("http://batch.tokenmill-test.invalid/v1/") for s in api.seen)


@contextlib.contextmanager
def deaf_server() -> Iterator[str]:
    """A server on 127.0.0.1 that accepts connections and never reads from them (a receive buffer
    of a few KiB): an upload to it stalls once the buffers between are full."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before listen: accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        listener.close()
        for sock in held:
            sock.close()


@pytest.mark.slow
def test_an_upload_the_server_stops_taking_times_out_and_the_job_ends_resumable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = [request(n, "x" * 2_000_000) for n in range(1, 17)]  # a 32 MB part: more than the buffers hold
    failed: list[BaseException] = []

    def run() -> None:
        try:
            run_backend(BatchApiSpec(url, timeout_s=1, retry_for_s=3), requests, tmp_path / "backend.json")
        except JobFailed as exc:
            failed.append(exc)

    with deaf_server() as url:
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), "the upload hangs on a server that takes none of it"
    stderr = capsys.readouterr().err
    assert re.search(r"uploading tm-\w+-part-00001\.jsonl: TimeoutError: the server took none of the upload "
                     r"for 1 s; trying again in", stderr), stderr
    assert failed and re.match(r"uploading \S+: TimeoutError: the server took none of the upload for 1 s "
                               r"\(gave up after \d attempt\(s\) in \d s, --retry-for\); every batch submitted is "
                               r"recorded: re-run the same command to resume", str(failed[0])), failed
    assert [p["status"] for p in state_of(tmp_path)["parts"]] == ["uploading"]


# ---- without a server ------------------------------------------------------------------------------
def request(line: int, text: str = "hello", url: str = "/v1/chat/completions") -> BatchRequest:
    body = {"messages": [{"role": "user", "content": text}]} if url != "/v1/completions" else {"prompt": text}
    return BatchRequest(line, f"r-{line}", url, body)


def split(requests: list[BatchRequest], max_requests: int, max_bytes: int) -> tuple[list[OpenPart], list[int]]:
    """The parts the splitter hands on (their files in memory), and the lines it refused."""
    parts: list[OpenPart] = []
    splitter = PartSplitter(max_requests, max_bytes, lambda url: io.BytesIO(), parts.append, keep_requests=True)
    refused = [r.line for r in requests if splitter.add(r) is not None]
    splitter.finish()
    return parts, refused


def test_parts_are_cut_before_a_line_would_pass_either_limit() -> None:
    line_bytes = len(batch_line(request(1)))
    requests = [request(n) for n in range(1, 11)]
    parts, refused = split(requests, max_requests=4, max_bytes=3 * line_bytes)  # bytes bind first: 3 a part
    assert not refused and [p.lines for p in parts] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    parts, _ = split(requests, max_requests=4, max_bytes=100 * line_bytes)  # requests bind: 4 a part
    assert [p.count for p in parts] == [4, 4, 2]
    for part in parts:  # whole lines, each a valid batch line, within both limits
        data = part.file.getvalue()  # type: ignore[attr-defined]
        assert len(data) == part.bytes <= 100 * line_bytes and data.endswith(b"\n")
        assert [json.loads(x)["custom_id"] for x in data.splitlines()] == [f"r-{n}" for n in part.lines]
    exact, _ = split(requests[:2], max_requests=10, max_bytes=2 * line_bytes)  # a part may fill to the byte
    assert [p.count for p in exact] == [2]


def test_a_line_over_the_byte_limit_is_refused_alone_and_urls_never_share_a_part() -> None:
    requests = [request(1), request(2, "x" * 500), request(3, url="/v1/completions"), request(4), request(5)]
    parts, refused = split(requests, max_requests=2, max_bytes=300)
    assert refused == [2]
    assert [(p.url, p.lines) for p in parts] == [
        ("/v1/chat/completions", [1, 4]), ("/v1/completions", [3]), ("/v1/chat/completions", [5])]  # as they fill
    assert [r.custom_id for r in parts[0].requests] == ["r-1", "r-4"]


def test_a_line_over_the_limit_is_an_error_row_from_check_and_from_run(tmp_path: Path) -> None:
    backend = BatchApiBackend(BatchApiSpec("http://127.0.0.1:9/v1", max_bytes_per_part=300))
    with pytest.raises(ValueError, match="over the 300-byte limit.*--max-bytes-per-part"):
        backend.check(request(1, "x" * 500))
    backend.check(request(2))
    backend.keep_state(tmp_path / "backend.json")
    errors = Rows()
    backend.run(iter([request(1, "x" * 500)]), ResultSink(Rows(), errors, None), StopFlag())  # no part: no call
    assert [(e["custom_id"], e["error"]["code"]) for e in errors.rows] == [("r-1", "request_too_large")]
    assert errors.rows[0]["error"]["message"].startswith("line 1: ")


def test_rows_are_coded_as_live_replies_are_and_unfinished_work_is_retried() -> None:
    results, errors = Rows(), Rows()
    sink = ResultSink(results, errors, None)
    body = {"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert hand_row(sink, request(1), {"response": {"status_code": 200, "request_id": "req_1", "body": body}})
    failures = [
        {"response": {"status_code": 400, "body": {"error": {"message": "bad temperature"}}}, "error": None},
        {"response": {"status_code": 429, "body": {"error": {"message": "slow down"}}}, "error": None},
        {"response": {"status_code": 503, "body": "unavailable"}, "error": None},
        {"response": None, "error": {"code": "batch_expired", "message": "not executed in time"}},
        {"response": None, "error": {"code": "invalid_input", "message": "line 7: body.model 'x' is not served"}},
    ]
    for n, row in enumerate(failures, start=2):
        assert not hand_row(sink, request(n), row)
    assert results.rows[0]["response"]["request_id"] == "req_1"
    codes = [e["error"]["code"] for e in errors.rows]
    assert codes == ["http_400", "rate_limited", "server_error", "timeout", "http_400"]
    assert all(map(is_transient, ("rate_limited", "server_error", "timeout"))) and not is_transient("http_400")
    # Our line leads the message, not the server's line in its part.
    assert errors.rows[4]["error"]["message"] == "line 6: invalid_input: body.model 'x' is not served"


def test_the_state_file_keys_each_job_apart_and_refuses_another_server(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = BatchState.open(tmp_path / "a" / "backend.json", "http://one")
    again = BatchState.open(tmp_path / "a" / "backend.json", "http://one")
    assert again.key == first.key  # the key is kept, not derived again
    (tmp_path / "b").mkdir()
    other = BatchState.open(tmp_path / "b" / "backend.json", "http://one")
    assert other.key != first.key and job_key(tmp_path, "t") != job_key(tmp_path, "u")
    first.record(PartRecord(1, "/v1/chat/completions", [1, 2, 3, 7], 0.0, SUBMITTED, "file-1", "batch_1"))
    assert line_ranges([7, 1, 3, 2]) == [[1, 3], [7, 7]]
    assert BatchState.open(first.path, "http://one").parts[1].lines == [1, 2, 3, 7]
    with pytest.raises(ValueError, match="submitted to http://one, not http://two"):
        BatchState.open(first.path, "http://two")


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-api"], "--batch-api submits the job to a server's Batch API: give it with --endpoint"),
    (["--endpoint", "http://x/v1", "--batch-api", "--ray"], "--batch-api .* cannot run on --ray"),
    (["--endpoint", "http://x/v1", "--poll-interval", "1"], "--poll-interval need --batch-api"),
    (["--endpoint", "http://x/v1", "--batch-api", "--max-requests-per-part", "0"],
     "--max-requests-per-part must be positive"),
    (["--endpoint", "http://x/v1", "--batch-api", "--max-bytes-per-part", "-1"],
     "--max-bytes-per-part must be positive"),
    (["--endpoint", "http://x/v1", "--batch-api", "--poll-interval", "0"], "--poll-interval must be positive"),
])
def test_flags_refuse_what_cannot_be(flags: list[str], message: str, tmp_path: Path) -> None:
    import argparse

    from tokenmill.jobs.flags import add_arguments, parse_job

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        parse_job(parser.parse_args(["in.jsonl", "-o", str(tmp_path), *flags]))


def test_flags_build_the_spec() -> None:
    import argparse

    from tokenmill.jobs.flags import add_arguments, backend_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = backend_spec(parser.parse_args(["in.jsonl", "-o", "out", "--endpoint", "http://x/v1", "--batch-api",
                                           "--model", "m", "--api-key", "k", "--poll-interval", "2",
                                           "--max-requests-per-part", "7", "--max-bytes-per-part", "9000"]))
    assert spec == BatchApiSpec("http://x/v1", "m", "k", poll_s=2.0, max_requests_per_part=7,
                                max_bytes_per_part=9000)
