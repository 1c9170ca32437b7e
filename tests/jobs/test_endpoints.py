"""Several endpoints in one process, and per-endpoint rate limits, against local stub servers.

Timing assertions are upper bounds on rates (a busy machine only slows a job down), never lower
bounds on speed.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
from bisect import bisect_left
from pathlib import Path

import pytest

from tokenmill.jobs.backends.base import BackendStats
from tokenmill.jobs.backends.build import _replica_backends
from tokenmill.jobs.backends.endpoint import EndpointBackend, EndpointSpec
from tokenmill.jobs.backends.http import RetryPolicy
from tokenmill.jobs.backends.rate_limit import RateLimit, estimated_tokens
from tokenmill.jobs.backends.ray import RaySpec
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobFailed
from tokenmill.jobs.flags import add_arguments, parse_job
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.runner import run_job

from .conftest import FAST_RETRY, assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

pytestmark = pytest.mark.usefixtures("no_proxies")  # the servers are on 127.0.0.1


def spec(url: str, **kw) -> EndpointSpec:
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("timeout_s", 5)
    return EndpointSpec(url, **kw)


def job(tmp_path: Path, contents: list[str], **body) -> JobConfig:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"r-{i}", c, **body) for i, c in enumerate(contents)])
    return JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=4), progress=False)


def docs(n: int) -> list[str]:
    return [f"doc {i}" for i in range(n)]


def arrivals(*stubs: StubServer) -> list[float]:
    return sorted(t for stub in stubs for times in stub.times.values() for t in times)


def most_in_any_window(times: list[float], seconds: float) -> int:
    """The most arrivals in any `seconds`-long window (each window starting at an arrival)."""
    return max(bisect_left(times, t + seconds) - i for i, t in enumerate(times))


def summary(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "out/summary.json").read_text())


def base(stub: StubServer) -> str:
    return stub.url.removesuffix("/v1")


def test_a_faster_endpoint_takes_more_rows(tmp_path: Path) -> None:
    """Each endpoint's workers pull from the one input: the slow one (0.5 s an answer) gets a few
    rows while the fast one does the rest, and every row is written once."""
    n = 40
    with StubServer() as fast, StubServer(delay=0.5) as slow:
        ep = EndpointBackend([spec(fast.url, concurrency=2), spec(slow.url, concurrency=2)], seed=0)
        assert run_job(job(tmp_path, docs(n)), ep).status == "done"
    assert_exactly_once(tmp_path / "out", n)
    by_fast, by_slow = sum(fast.attempts.values()), sum(slow.attempts.values())
    assert by_fast + by_slow == n and by_slow >= 1 and by_fast >= 3 * by_slow
    assert summary(tmp_path)["engine"]["rows_by_endpoint"] == {base(fast): by_fast, base(slow): by_slow}


def test_an_endpoint_that_goes_down_leaves_its_rows_to_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One endpoint drops every connection after its 8th request, for good: its breaker opens, the
    requests it held go to the other endpoint, it is left out after --retry-for, and the job
    finishes with every row once and no error rows."""
    n = 40
    retry = RetryPolicy(retry_for=0.5, base_delay=0.01, max_delay=0.05, max_probe_delay=0.1)
    with (StubServer(delay=0.02, outage_after=8, outage_s=math.inf) as dying,
          StubServer(delay=0.15) as steady):  # 32+ rows at 4 × 0.15 s: the job outlives the 0.5 s
        ep = EndpointBackend([spec(dying.url, concurrency=4, retry=retry),
                              spec(steady.url, concurrency=4, retry=retry)], seed=0)
        assert run_job(job(tmp_path, docs(n)), ep).status == "done"
    assert_exactly_once(tmp_path / "out", n)
    assert read_jsonl(tmp_path / "out/errors.jsonl") == []
    assert dying.down_hits["POST"] >= 1
    assert summary(tmp_path)["engine"]["rows_by_endpoint"] == {base(dying): 8, base(steady): n - 8}
    err = capsys.readouterr().err
    assert f"the endpoint {base(dying)} has not answered for 0.5 s" in err
    assert "1 other endpoint(s) carry on with its requests" in err


def test_the_job_fails_resumably_only_when_every_endpoint_is_gone(tmp_path: Path) -> None:
    retry = RetryPolicy(retry_for=0.3, base_delay=0.01, max_delay=0.05, max_probe_delay=0.1)
    dead = [_unused_url(), _unused_url()]
    ep = EndpointBackend([spec(url, concurrency=2, retry=retry) for url in dead], seed=0)
    with pytest.raises(JobFailed, match=r"none of the 2 endpoints has answered for 0.3 s .*re-run the same command"):
        run_job(job(tmp_path, docs(6)), ep)
    assert read_jsonl(tmp_path / "out/results.jsonl") == read_jsonl(tmp_path / "out/errors.jsonl") == []


def test_requests_per_minute_hold_over_any_second(tmp_path: Path) -> None:
    """600 a minute = 10 a second, in bursts of at most one second's share: 40 requests take at
    least 3 s after the first 10, and no 1-s window sees more than 10 + 10."""
    n, per_s = 40, 10
    with StubServer() as stub:
        ep = EndpointBackend(spec(stub.url, concurrency=8, rate_limit=RateLimit(requests_per_minute=60 * per_s)))
        assert run_job(job(tmp_path, docs(n)), ep).status == "done"
    times = arrivals(stub)
    assert len(times) == n
    assert most_in_any_window(times, 1.0) <= 2 * per_s + 1  # the burst, and one second's refill
    assert times[-1] - times[0] >= (n - per_s) / per_s - 0.2


def test_tokens_per_minute_count_the_prompt_and_max_tokens(tmp_path: Path) -> None:
    """Each request is 160 characters (40 tokens) + max_tokens 10 = 50 tokens; 12,000 a minute =
    200 a second = 4 requests a second, after a burst of 4."""
    n, per_s = 12, 4
    contents = [f"{i:02d}" + "x" * 158 for i in range(n)]
    with StubServer() as stub:
        ep = EndpointBackend(spec(stub.url, concurrency=8, rate_limit=RateLimit(tokens_per_minute=12_000)))
        assert run_job(job(tmp_path, contents, max_tokens=10), ep).status == "done"
    times = arrivals(stub)
    assert len(times) == n
    assert most_in_any_window(times, 1.0) <= 2 * per_s + 1
    assert times[-1] - times[0] >= (n - per_s) / per_s - 0.2


def test_a_request_over_the_whole_token_limit_still_goes(tmp_path: Path) -> None:
    """100 + 4 tokens against 60 a minute: it could never fit, so it goes when the bucket is full."""
    with StubServer() as stub:
        ep = EndpointBackend(spec(stub.url, rate_limit=RateLimit(tokens_per_minute=60)))
        assert run_job(job(tmp_path, ["y" * 400]), ep).status == "done"


def test_estimated_tokens_as_openai_counts_them() -> None:
    chat = {"messages": [{"role": "system", "content": "a" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "b" * 80}]}],
            "max_tokens": 20, "n": 2}
    assert estimated_tokens(BatchRequest(1, "c", "/v1/chat/completions", chat)) == 10 + 20 + 2 * 20
    assert estimated_tokens(BatchRequest(1, "p", "/v1/completions", {"prompt": "z" * 41, "max_tokens": 5})) == 15
    assert estimated_tokens(BatchRequest(1, "t", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5})) == 8


def test_a_429_with_retry_after_pauses_the_whole_endpoint(tmp_path: Path) -> None:
    """The first request's 429 says Retry-After: 1. Requests other workers had already sent arrive
    at once; after them nothing reaches the endpoint until the second is over (without the pause,
    the other 3 workers would send one every 0.2 s)."""
    delay = 0.2
    with StubServer({"doc 0": ["429-wait"]}, delay=delay) as stub:
        ep = EndpointBackend(spec(stub.url, concurrency=4))
        assert run_job(job(tmp_path, docs(12)), ep).status == "done"
    assert_exactly_once(tmp_path / "out", 12)
    replied = stub.times["doc 0"][0] + delay  # the 429 left the stub no earlier than this
    settled = [t for t in arrivals(stub) if t > replied + 0.3]  # what was sent before the 429 came back is in
    assert settled and settled[0] >= replied + 0.95


def parse_backend(*flags: str):
    """The backend of `tokenmill run in.jsonl -o out FLAGS`; JobError in the flags' words."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parse_job(parser.parse_args(["in.jsonl", "-o", "out", *flags]))[1]


def test_flags_build_several_endpoints_with_their_limits() -> None:
    a, b = "http://a:8000/v1", "http://b:8000/v1"
    endpoints = parse_backend("--endpoint", a, "--endpoint", b, "--concurrency", "8",
                              "--max-requests-per-minute", "600", "--max-tokens-per-minute", "90000")
    assert isinstance(endpoints, tuple) and [e.url for e in endpoints] == [a, b]
    assert all(e.concurrency == 8 and e.rate_limit == RateLimit(600, 90_000) for e in endpoints)
    assert isinstance(parse_backend("--endpoint", a), EndpointSpec)
    assert parse_backend("--endpoint", a).rate_limit == RateLimit()  # no limit, no limiter
    # --ray: each of the 2 replicas gets half of each endpoint's limits (and of the concurrency).
    ray = parse_backend("--ray", "--replicas", "2", "--endpoint", a, "--endpoint", b, "--concurrency", "8",
                        "--max-requests-per-minute", "600")
    assert isinstance(ray, RaySpec)
    replicas = _replica_backends(ray)
    assert [r.endpoints[0].spec.rate_limit for r in replicas] == [RateLimit(300)] * 2  # type: ignore[attr-defined]
    assert [r.endpoints[0].spec.concurrency for r in replicas] == [4] * 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-requests-per-minute", "-5"], "--max-requests-per-minute must be positive, got -5"),
    (["--max-tokens-per-minute", "0"], "--max-tokens-per-minute must be positive, got 0"),
    (["--concurrency", "0"], "--concurrency must be positive"),
])
def test_flag_errors_name_the_flag(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_backend("--endpoint", "http://a:8000/v1", "--endpoint", "http://b:8000/v1", *flags)


def test_rate_limits_need_live_requests_to_an_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.cli import main

    with pytest.raises(ValueError, match="pace an --endpoint"):
        parse_backend("--max-requests-per-minute", "10")
    with pytest.raises(ValueError, match="--batch-api leaves the pace"):
        parse_backend("--batch-api", "--endpoint", "http://a:8000/v1", "--max-tokens-per-minute", "10")
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "hello")])
    assert main(["run", str(path), "-o", str(tmp_path / "out"), "--no-progress", "--endpoint", "http://a:8000/v1",
                 "--max-requests-per-minute", "-1"]) == 2
    assert "--max-requests-per-minute must be positive, got -1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before claiming anything


def test_choose_takes_a_candidate_with_several_endpoints() -> None:
    from tokenmill.choose.candidates import parse_candidate

    api = parse_candidate("api=--endpoint http://a:8000/v1 --endpoint http://b:8000/v1 --model m "
                          "--max-requests-per-minute 60")
    assert isinstance(api.backend, tuple) and len(api.backend) == 2 and api.model() == "m"
    assert api.backend[0].rate_limit == RateLimit(60)


def _unused_url() -> str:
    """A port nothing listens on: connections are refused, like a server that was killed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_rows_by_endpoint_add_up_over_batches() -> None:
    """--ray: each replica's batch reports its own endpoint's rows; the job's stats add them."""
    total = BackendStats()
    for part in ({"http://a": 3}, {"http://b": 2}, {"http://a": 1}):
        total.add(BackendStats(retries=1, rows_by_endpoint=part))
    assert total.rows_by_endpoint == {"http://a": 4, "http://b": 2} and total.retries == 3
