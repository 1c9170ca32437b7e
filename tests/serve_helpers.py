"""A real `tokenmill serve` (uvicorn, in a thread) on a free loopback port, for tests that need one.

Servers must not overlap on one `LLM`: the engine is not thread-safe and each server owns it
through its own engine loop while it runs.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.llm import LLM
from tokenmill.serve.app import ServeState, create_app


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    state: ServeState

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(llm: LLM, state_dir: Path, model_name: str, api_key: str | None = None,
            **state_options: Any) -> Iterator[Running]:
    """`state_options`: ServeState's other fields (max_request_bytes=..., docs=False, ...)."""
    state = ServeState(llm, model_name=model_name, state_dir=state_dir, api_key=api_key, **state_options)
    port = _free_port()
    config = uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def scrape(server: Running) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, its labels) → value."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
