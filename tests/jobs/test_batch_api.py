"""The Batch API backend (`tokenmill run --endpoint URL --batch-api`) end to end against a real
`tokenmill serve` on 127.0.0.1 (one for the module, over the embedded model): parts within the
limits, one url per part, every row exactly once; a real `kill -9`, and a state file as a kill
between creating a batch and recording its id leaves it, each resumed with no part submitted
twice; a merge cut short; a stop with batches running. Plus the part splitter, the row coding
and the flags, without a server."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

    from tokenmill.jobs.flags import add_arguments, backend_spec

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        backend_spec(parser.parse_args(["in.jsonl", "-o", str(tmp_path), *flags]))


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
