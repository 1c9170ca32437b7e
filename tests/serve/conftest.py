"""A real server on a free loopback port (tests/serve_helpers.py), over one engine shared by the
whole tests/serve session.

Servers never overlap (each module holds at most one at a time): the engine is not thread-safe
and each server owns it through its own engine loop while it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from tests import serve_helpers
from tests.serve_helpers import Running
from tokenmill.engine.llm import LLM

MODEL = "smollm-test"
__all__ = ["MODEL", "Running", "serving"]


@pytest.fixture(scope="session")
def serve_llm(smollm_weights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=32, max_model_len=512, scheduling_policy="priority")


def serving(llm: LLM, state_dir: Path, api_key: str | None = None,
            **state_options: Any) -> AbstractContextManager[Running]:
    """The shared test server, serving the model as MODEL; `state_options` go to ServeState."""
    return serve_helpers.serving(llm, state_dir, MODEL, api_key, **state_options)


@pytest.fixture(scope="module")
def server(serve_llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serving(serve_llm, tmp_path_factory.mktemp("serve-state")) as running:
        yield running
