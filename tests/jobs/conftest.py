"""Helpers for the job tests: input files, a fake backend, reading the outputs back."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.backends.http import RetryPolicy
from tokenmill.jobs.input.request import BatchRequest

# Endpoint tests: a few quick tries, so a failure is final within a second.
FAST_RETRY = RetryPolicy(max_attempts=4, base_delay=0.01, max_delay=0.05)


def batch_line(custom_id: str, content: str, url: str = "/v1/chat/completions", **body: Any) -> dict[str, Any]:
    if url == "/v1/completions":
        body = {"prompt": content, **body}
    else:
        body = {"messages": [{"role": "user", "content": content}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_exactly_once(out: Path, input_lines: int) -> None:
    """Every input line has exactly one row across results and errors, and results have unique ids."""
    results, errors = read_jsonl(out / "results.jsonl"), read_jsonl(out / "errors.jsonl")
    ids = [r["custom_id"] for r in results]
    assert len(ids) == len(set(ids)), "a custom_id has two results"
    assert len(results) + len(errors) == input_lines
    assert not set(ids) & {e["custom_id"] for e in errors if e["error"]["code"] != "invalid_input"}


def kill_9_after(cmd: list[str], results: Path, rows: int, timeout_s: float = 120) -> int:
    """Run `cmd` (a `tokenmill run`), kill -9 it as soon as `results` holds `rows` rows, and
    return how many whole rows it holds then. A job that exits, or writes too few within
    `timeout_s`, fails."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout_s
    while not (results.exists() and results.read_bytes().count(b"\n") >= rows):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, f"fewer than {rows} result(s) within {timeout_s:g} s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return results.read_bytes().count(b"\n")


class EchoBackend:
    """Answers instantly. Prompts containing "final-fail" get a 400; "flaky" fails once (transient)."""

    kind = "fake"
    model = "echo"

    def __init__(self) -> None:
        self.served: list[str] = []
        self.flaky_failed: set[str] = set()

    def check(self, request: BatchRequest) -> None:
        if "refuse" in json.dumps(request.body):
            raise ValueError("body says refuse")

    def start(self) -> None:
        pass

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        for request in requests:
            if stop.requested:
                break
            self.served.append(request.custom_id)
            text = json.dumps(request.body)
            if "final-fail" in text:
                sink.error(request, "http_400", "HTTP 400: no")
            elif "flaky" in text and request.custom_id not in self.flaky_failed:
                self.flaky_failed.add(request.custom_id)
                sink.error(request, "server_error", "HTTP 500: try later")
            else:
                usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                         "prompt_tokens_details": {"cached_tokens": 3}}
                sink.result(request, {"object": "chat.completion", "choices": [], "usage": usage})
        return BackendStats()


@pytest.fixture
def echo() -> EchoBackend:
    return EchoBackend()


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy from the environment may carry a test's traffic to its servers on 127.0.0.1 elsewhere."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
