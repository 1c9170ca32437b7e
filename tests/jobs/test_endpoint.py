"""The endpoint backend against a local stub server that fails on cue (127.0.0.1 only)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from email.utils import formatdate
from pathlib import Path

import pytest

from tokenmill.jobs.backends.base import ResultSink, StopFlag
from tokenmill.jobs.backends.endpoint import EndpointBackend, EndpointSpec, parse_retry_after
from tokenmill.jobs.backends.http import RetryPolicy
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobFailed
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.runner import run_job

from .conftest import FAST_RETRY, assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

# No attempt cap: a time budget, short backoffs, and an open breaker probing every 0.2 s at most.
OUTAGE_RETRY = RetryPolicy(retry_for=30, base_delay=0.01, max_delay=0.05, max_probe_delay=0.2)

pytestmark = pytest.mark.usefixtures("no_proxies")  # the servers are on 127.0.0.1


def backend(stub: StubServer, **kw) -> EndpointBackend:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeout_s", 0.5)
    return EndpointBackend(EndpointSpec(stub.url, **kw), seed=0)


def job(tmp_path: Path, contents: list[str], **kw) -> JobConfig:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i}", c) for i, c in enumerate(contents)])
    options = kw.pop("options", DocumentOptions(max_tokens=4))
    return JobConfig(input=path, output=tmp_path / "out", options=options, progress=False, **kw)


def test_transient_failures_are_retried_and_a_400_is_final(tmp_path: Path) -> None:
    script = {"rate": ["429"], "boom": ["500", "500"], "slow": ["slow"], "drop": ["drop"], "bad": ["400"]}
    contents = ["plain", "rate", "boom", "slow", "drop", "bad"]
    with StubServer(script, slow_s=1.5) as stub:
        assert run_job(job(tmp_path, contents), backend(stub)).status == "failed"
    assert stub.attempts == {"plain": 1, "rate": 2, "boom": 3, "slow": 2, "drop": 2, "bad": 1}
    results = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out/results.jsonl")}
    assert sorted(results) == ["r-0", "r-1", "r-2", "r-3", "r-4"]
    body = results["r-1"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "echo: rate"
    [error] = read_jsonl(tmp_path / "out/errors.jsonl")
    assert error["custom_id"] == "r-5" and error["error"]["code"] == "http_400"
    assert error["error"]["message"] == "line 6: HTTP 400: stub says 400"
    assert error["response"]["status_code"] == 400
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["tokens"]["completion"] == 5 * 2 and summary["tokens"]["cached"] == 5 * 2
    assert summary["engine"]["retries"] == 5


def test_exhausted_retries_are_tried_again_on_rerun(tmp_path: Path) -> None:
    config = job(tmp_path, ["fine", "down", "bad"])
    with StubServer({"down": ["500"] * 4, "bad": ["400"]}) as stub:
        assert run_job(config, backend(stub)).status == "failed"
        [error] = [e for e in read_jsonl(tmp_path / "out/errors.jsonl") if e["custom_id"] == "r-1"]
        assert error["error"]["code"] == "server_error" and "gave up after 4 attempt(s)" in error["error"]["message"]
        assert run_job(config, backend(stub)).status == "failed"  # only the 400 is left failed
    assert stub.attempts == {"fine": 1, "down": 5, "bad": 1}
    assert [e["custom_id"] for e in read_jsonl(tmp_path / "out/errors.jsonl")] == ["r-2"]
    assert_exactly_once(tmp_path / "out", 3)


def test_a_request_is_retried_until_its_time_budget_is_spent(tmp_path: Path) -> None:
    budget = RetryPolicy(retry_for=0.3, base_delay=0.01, max_delay=0.05)  # and no attempt cap
    with StubServer({"down": ["500"] * 1000}) as stub:
        assert run_job(job(tmp_path, ["fine", "down"]), backend(stub, retry=budget)).status == "failed"
    [error] = read_jsonl(tmp_path / "out/errors.jsonl")
    assert error["custom_id"] == "r-1" and error["error"]["code"] == "server_error"
    assert "gave up after" in error["error"]["message"]
    first, *_, last = stub.times["down"]
    # Retried for its budget (the give-up comes once the next wait would pass it), and then not on:
    # its 1,000 scripted 500s would take over 20 s at this pace. (A 500 is the request's: no breaker.)
    assert stub.attempts["down"] >= 4 and budget.retry_for - budget.max_delay - 0.1 <= last - first
    assert stub.attempts["down"] < 1000 and last - first < budget.retry_for + 2


def test_an_outage_mid_job_is_waited_out_with_a_few_probes(tmp_path: Path) -> None:
    """The server drops every connection for 1.5 s after its 12th request: the breaker holds the
    workers (each loses the attempt it had in flight, no more), probes, and the job finishes."""
    n, concurrency = 48, 8
    with StubServer(delay=0.02, outage_after=12, outage_s=1.5) as stub:
        ep = backend(stub, concurrency=concurrency, retry=OUTAGE_RETRY, timeout_s=5)  # only drops fail
        assert run_job(job(tmp_path, [f"doc {i}" for i in range(n)]), ep).status == "done"
    assert_exactly_once(tmp_path / "out", n)
    assert read_jsonl(tmp_path / "out/errors.jsonl") == []
    dropped, probes = stub.down_hits["POST"], stub.down_hits["GET"]
    assert 1 <= dropped <= 2 * concurrency and 1 <= probes <= 20  # not concurrency × attempts
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["engine"]["retries"] == dropped  # each lost attempt tried again once, after the outage


def test_an_endpoint_that_never_comes_back_ends_the_job_resumably(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens: after --retry-for the job stops with exit 3 and no error rows, and a re-run
    against a live server does every row (once)."""
    from tokenmill.cli import main

    config, dead = job(tmp_path, [f"doc {i}" for i in range(20)]), _unused_url()
    start = time.monotonic()
    code = main(["run", str(config.input), "-o", str(config.output), "--max-tokens", "4", "--no-progress",
                 "--endpoint", dead, "--concurrency", "8", "--retry-for", "1", "--max-attempts", "6"])
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 3 and elapsed < 10, err
    assert f"the endpoint {dead.removesuffix('/v1')} has not answered for 1 s" in err
    assert "ClientConnectorError" in err and "re-run the same command to resume" in err
    assert read_jsonl(config.output / "results.jsonl") == read_jsonl(config.output / "errors.jsonl") == []
    with StubServer() as stub:
        assert run_job(config, backend(stub)).status == "done"
    assert_exactly_once(config.output, 20)
    assert read_jsonl(config.output / "errors.jsonl") == []



@pytest.mark.parametrize("simple", [False, True], ids=["batch-lines", "simple-lines"])
def test_text_that_is_not_text_is_a_bad_line_not_a_failed_job(tmp_path: Path, simple: bool) -> None:
    """A lone surrogate (a JSON "\\udfff" escape without its other half) can be neither sent nor
    written: in an id, a prompt, a message or a field name it makes its line an error row, named,
    and the other lines run (it used to end the job with orjson's TypeError)."""
    odd = "a\udfffb"
    if simple:
        rows = [{"id": "r-0", "prompt": "fine"}, {"id": odd, "prompt": "x"}, {"id": "r-2", "prompt": odd},
                {"id": "r-3", "messages": [{"role": "user", "content": odd}]}, {"id": "r-4", "prompt": "fine"}]
        named = ['"id" holds', '"prompt" holds', "messages[0].content holds"]
    else:
        rows = [batch_line("r-0", "fine"), batch_line(odd, "x"), batch_line("r-2", odd),
                batch_line("r-3", "x", **{odd: 1}), batch_line("r-4", "fine")]
        named = ['"custom_id" holds', "body.messages[0].content holds", f"body[{json.dumps(odd)}] holds"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))  # ASCII: the surrogate as its escape
    config = JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=4), progress=False)
    with StubServer() as stub:
        assert run_job(config, backend(stub)).status == "failed"  # done, with error rows
    assert_exactly_once(config.output, len(rows))
    assert sorted(row["custom_id"] for row in read_jsonl(config.output / "results.jsonl")) == ["r-0", "r-4"]
    errors = read_jsonl(config.output / "errors.jsonl")
    assert [row["custom_id"] for row in errors] == [None, "r-2", "r-3"]
    for row, (line, field) in zip(errors, zip([2, 3, 4], named, strict=True), strict=True):
        assert row["error"]["code"] == "invalid_input"
        assert row["error"]["message"].startswith(f"line {line}: {field} a lone surrogate (\\udfff at character ")

def test_a_stop_wakes_workers_held_by_an_open_breaker(tmp_path: Path) -> None:
    stop = StopFlag()
    with StubServer() as stub:
        stub.go_down()
        threading.Timer(0.5, stop.request).start()
        start = time.monotonic()
        assert run_job(job(tmp_path, [f"doc {i}" for i in range(10)]), backend(stub, concurrency=4,
                       retry=OUTAGE_RETRY), stop=stop).status == "interrupted"
        assert time.monotonic() - start < 3
    assert read_jsonl(tmp_path / "out/errors.jsonl") == []  # held requests are not done, not failed


def test_after_giving_up_the_next_run_probes_once() -> None:
    """A Ray replica runs batch after batch (and a failed one again, request by request): once the
    endpoint was given up on, each run asks once and fails at once, until it answers again."""
    give_up_fast = RetryPolicy(retry_for=1, base_delay=0.01, max_delay=0.05)

    def one_run(ep: EndpointBackend) -> list[str]:
        rows = RowList()
        ep.run(iter([BatchRequest(1, "a", "/v1/completions", {"prompt": "a"})]), ResultSink(rows, rows, None),
               StopFlag())
        return [r["custom_id"] for r in rows if r["error"] is None]

    with StubServer() as stub:
        ep = backend(stub, concurrency=2, retry=give_up_fast)
        stub.go_down()
        with pytest.raises(JobFailed, match="has not answered for 1 s"):
            one_run(ep)
        before = dict(stub.down_hits)
        start = time.monotonic()
        with pytest.raises(JobFailed, match="re-run the same command"):
            one_run(ep)
        assert time.monotonic() - start < give_up_fast.retry_for  # not another --retry-for
        # One probe, no request; aiohttp sends a GET whose connection was dropped once more itself.
        assert stub.down_hits["POST"] == before["POST"] and stub.down_hits["GET"] - before["GET"] in (1, 2)
        stub.come_back()
        assert one_run(ep) == ["a"]


class RowList(list[dict]):
    def write(self, row: dict, entry: object = None) -> None:
        self.append(row)


def _unused_url() -> str:
    """A port nothing listens on: connections are refused, like a server that was killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_retry_after_is_honoured_over_the_backoff(tmp_path: Path) -> None:
    slow_backoff = RetryPolicy(max_attempts=3, base_delay=30.0)  # would take 15+ s without Retry-After
    with StubServer({"a": ["429"], "b": ["429-wait"]}) as stub:
        start = time.monotonic()
        assert run_job(job(tmp_path, ["a", "b"]), backend(stub, retry=slow_backoff)).status == "done"
        elapsed = time.monotonic() - start
    first, second = stub.times["b"]
    assert second - first >= 0.95 and elapsed < 5


def test_concurrency_bounds_requests_in_flight(tmp_path: Path) -> None:
    with StubServer(delay=0.1) as stub:
        assert run_job(job(tmp_path, [f"doc {i}" for i in range(12)]), backend(stub, concurrency=3)).status == "done"
    assert stub.max_inflight == 3
    assert_exactly_once(tmp_path / "out", 12)


def test_model_override_api_key_and_base_url(tmp_path: Path) -> None:
    config = job(tmp_path, ["x"], options=DocumentOptions(model="served-model", temperature=0))
    with StubServer() as stub:
        ep = EndpointBackend(EndpointSpec(stub.url.removesuffix("/v1") + "/", api_key="sk-test", timeout_s=5))
        assert run_job(config, ep).status == "done"
    assert stub.bodies[0]["model"] == "served-model" and stub.bodies[0]["temperature"] == 0
    assert stub.headers[0]["Authorization"] == "Bearer sk-test"


def test_parse_retry_after() -> None:
    assert parse_retry_after("0") == 0 and parse_retry_after("2.5") == 2.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    now = time.time()
    assert parse_retry_after(formatdate(now + 30, usegmt=True), now=now) == pytest.approx(30, abs=1)
    assert parse_retry_after(formatdate(now - 30, usegmt=True), now=now) == 0


def test_backoff_grows_with_jitter() -> None:
    import random

    policy, rng = RetryPolicy(base_delay=1.0, max_delay=8.0), random.Random(0)
    delays = [policy.backoff(a, rng) for a in (1, 2, 3, 4, 5, 6)]
    for attempt, delay in zip((1, 2, 3, 4, 5, 6), delays, strict=True):
        full = min(8.0, 2 ** (attempt - 1))
        assert full / 2 <= delay <= full


@pytest.mark.slow
def test_ctrl_c_stops_and_a_rerun_resumes(tmp_path: Path) -> None:
    """A real SIGINT to a running `tokenmill run`: exit 130 with a resume hint, then finish exactly once."""
    contents = [f"doc {i}" for i in range(20)]
    config = job(tmp_path, contents)
    out = tmp_path / "out"
    with StubServer(delay=0.25) as stub:
        cmd = [sys.executable, "-m", "tokenmill", "run", str(config.input), "-o", str(out), "--max-tokens", "4",
               "--endpoint", stub.url, "--concurrency", "2", "--no-progress"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for_lines(out / "results.jsonl", 2, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Re-run the same command to resume" in err
        partial = len(read_jsonl(out / "results.jsonl"))
        assert 2 <= partial < 20
        rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {partial} done" in rerun.stderr
    assert_exactly_once(out, 20)


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended early: {proc.communicate()}")
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no {n} results within {timeout} s")


def test_the_input_comes_as_an_argument_or_as_vllm_run_batch_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tokenmill run -i IN -o OUT` as `vllm run-batch -i IN -o OUT`; given twice or not at all, a
    clear refusal before any work."""
    from tokenmill.cli import main

    config = job(tmp_path, [f"doc {i}" for i in range(3)])
    with StubServer() as stub:
        flags = ["-o", str(config.output), "--max-tokens", "4", "--no-progress", "--endpoint", stub.url]
        assert main(["run", "-i", str(config.input), *flags]) == 0
    assert_exactly_once(config.output, 3)
    assert main(["run", str(config.input), "-i", str(config.input), *flags]) == 2
    assert main(["run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("give the input file once: as the first argument or with -i/--input") == 2
    assert f"(got {config.input} and {config.input})" in err
