"""A real server on a free loopback port, over one engine shared by the whole tests/serve session.

Servers never overlap (each module holds at most one at a time): the engine is not thread-safe
and each server owns it through its own engine loop while it runs.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from tokenmill.engine.llm import LLM
from tokenmill.serve.app import ServeState, create_app

MODEL = "smollm-test"


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    state: ServeState

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


@pytest.fixture(scope="session")
def serve_llm(smollm_weights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=32, max_model_len=512, scheduling_policy="priority")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(llm: LLM, state_dir: Path, api_key: str | None = None) -> Iterator[Running]:
    state = ServeState(llm, model_name=MODEL, state_dir=state_dir, api_key=api_key)
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


@pytest.fixture(scope="module")
def server(serve_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serving(serve_llm, tmp_path_factory.mktemp("serve-state")) as running:
        yield running
