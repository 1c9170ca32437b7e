"""The endpoint backend against a local stub server that fails on cue (127.0.0.1 only)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from email.utils import formatdate
from pathlib import Path

import pytest

from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.endpoint import EndpointBackend, RetryPolicy, parse_retry_after
from tokenmill.jobs.runner import run_job
from tokenmill.jobs.spec import DocumentOptions

from .conftest import assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05)


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub is on 127.0.0.1: no proxy from the environment may carry the traffic elsewhere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def backend(stub: StubServer, **kw) -> EndpointBackend:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeout", 0.5)
    return EndpointBackend(stub.url, seed=0, **kw)


def job(tmp_path: Path, contents: list[str], **kw) -> JobConfig:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i}", c) for i, c in enumerate(contents)])
    options = kw.pop("options", DocumentOptions(max_tokens=4))
    return JobConfig(input=path, output=tmp_path / "out", options=options, progress=False, **kw)


def test_transient_failures_are_retried_and_a_400_is_final(tmp_path: Path) -> None:
    script = {"rate": ["429"], "boom": ["500", "500"], "slow": ["slow"], "drop": ["drop"], "bad": ["400"]}
    contents = ["plain", "rate", "boom", "slow", "drop", "bad"]
    with StubServer(script, slow_s=1.5) as stub:
        assert run_job(job(tmp_path, contents), backend(stub)) == 1
    assert stub.attempts == {"plain": 1, "rate": 2, "boom": 3, "slow": 2, "drop": 2, "bad": 1}
    results = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out/results.jsonl")}
    assert sorted(results) == ["r-0", "r-1", "r-2", "r-3", "r-4"]
    body = results["r-1"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "echo: rate"
    [error] = read_jsonl(tmp_path / "out/errors.jsonl")
    assert error["custom_id"] == "r-5" and error["error"]["code"] == "http_400"
    assert error["error"]["message"] == "HTTP 400: stub says 400"
    assert error["response"]["status_code"] == 400
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    assert summary["tokens"]["completion"] == 5 * 2 and summary["tokens"]["cached"] == 5 * 2
    assert summary["engine"]["retries"] == 5


def test_exhausted_retries_are_tried_again_on_rerun(tmp_path: Path) -> None:
    config = job(tmp_path, ["fine", "down", "bad"])
    with StubServer({"down": ["500"] * 4, "bad": ["400"]}) as stub:
        assert run_job(config, backend(stub)) == 1
        [error] = [e for e in read_jsonl(tmp_path / "out/errors.jsonl") if e["custom_id"] == "r-1"]
        assert error["error"]["code"] == "server_error" and "gave up after 4 attempt(s)" in error["error"]["message"]
        assert run_job(config, backend(stub)) == 1  # only the 400 is left failed
    assert stub.attempts == {"fine": 1, "down": 5, "bad": 1}
    assert [e["custom_id"] for e in read_jsonl(tmp_path / "out/errors.jsonl")] == ["r-2"]
    assert_exactly_once(tmp_path / "out", 3)


def test_retry_after_is_honoured_over_the_backoff(tmp_path: Path) -> None:
    slow_backoff = RetryPolicy(max_attempts=3, base_delay=30.0)  # would take 15+ s without Retry-After
    with StubServer({"a": ["429"], "b": ["429-wait"]}) as stub:
        start = time.monotonic()
        assert run_job(job(tmp_path, ["a", "b"]), backend(stub, retry=slow_backoff)) == 0
        elapsed = time.monotonic() - start
    first, second = stub.times["b"]
    assert second - first >= 0.95 and elapsed < 5


def test_concurrency_bounds_requests_in_flight(tmp_path: Path) -> None:
    with StubServer(delay=0.1) as stub:
        assert run_job(job(tmp_path, [f"doc {i}" for i in range(12)]), backend(stub, concurrency=3)) == 0
    assert stub.max_inflight == 3
    assert_exactly_once(tmp_path / "out", 12)


def test_model_override_api_key_and_base_url(tmp_path: Path) -> None:
    config = job(tmp_path, ["x"], options=DocumentOptions(model="served-model", temperature=0))
    with StubServer() as stub:
        ep = EndpointBackend(stub.url.removesuffix("/v1") + "/", api_key="sk-test", timeout=5)
        assert run_job(config, ep) == 0
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
