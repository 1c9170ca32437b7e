"""Short prompts pass long ones waiting to be tokenized: four long prompts that each take a while to
tokenize hold the server's tokenizer threads, and a 2-token request beside them still answers at
once (first come, first served on one pool of two threads, it waited for all four)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MODEL, serving
from tokenmill.engine.llm import LLM

SLOW_S = 1.5  # what tokenizing each long prompt is made to take (a 1.3 MB prompt takes about that here)
LONG_CHARS = 200_000


def test_a_short_request_is_not_queued_behind_long_prompts(
    serve_llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(serve_llm, tmp_path) as server:
        backend = server.state.backend
        prepare = backend.prepare

        def slow_when_long(request: Any, *args: Any, **kwargs: Any) -> Any:
            if len(str(request.body.get("prompt", ""))) >= LONG_CHARS:
                time.sleep(SLOW_S)  # on the tokenizer thread, as a long tokenization holds it
            return prepare(request, *args, **kwargs)

        monkeypatch.setattr(backend, "prepare", slow_when_long)

        async def load() -> tuple[float, list[int]]:
            async with httpx.AsyncClient(base_url=server.v1, timeout=60) as client:
                long_body = {"model": MODEL, "prompt": "word " * (LONG_CHARS // 5), "max_tokens": 1}
                longs = [asyncio.create_task(client.post("/completions", json=long_body)) for _ in range(4)]
                await asyncio.sleep(0.3)  # the long ones are being tokenized, two more queued behind them
                start = time.monotonic()
                short = await client.post("/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                took = time.monotonic() - start
                assert short.status_code == 200, short.text
                return took, [r.status_code for r in await asyncio.gather(*longs)]

        took, long_statuses = asyncio.run(load())
        assert took < 0.5 * SLOW_S, f"the short request took {took:.2f} s behind the long prompts"
        assert len(long_statuses) == 4  # and the long ones were answered too (here: too long for the context)
