"""Short prompts pass long ones waiting to be tokenized: while long prompts hold every thread of the
server's tokenizer lane, with more queued behind them, a 2-token request still answers (first come,
first served on one pool, it waited for all of them)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MODEL, serving
from tokenmill.engine.llm import LLM
from tokenmill.serve.backend import SHORT_PROMPT_CHARS, TOKENIZER_THREADS

LONG_CHARS = 200_000
assert LONG_CHARS > SHORT_PROMPT_CHARS
LONG_REQUESTS = TOKENIZER_THREADS + 2  # every long-lane thread held, and two queued behind them
# The short request answers in well under a second; queued behind the held lane it would not answer
# until the long prompts are let go, which happens only after it answered or gave up.
SHORT_TIMEOUT_S = 10
HOLD_S = 6 * SHORT_TIMEOUT_S  # bounds only a broken run: the long prompts are let go before


def test_a_short_request_is_not_queued_behind_long_prompts(
    serve_llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(serve_llm, tmp_path) as server:
        backend = server.state.backend
        prepare, submit = backend.prepare, backend._tokenizers.submit
        release = threading.Event()  # lets the long prompts' tokenizing end
        changed = threading.Condition()
        lane = {"queued": 0, "held": 0}  # long prompts handed to the long lane / on one of its threads

        def count(key: str) -> None:
            with changed:
                lane[key] += 1
                changed.notify_all()

        def queue_long(*args: Any, **kwargs: Any) -> Any:
            future = submit(*args, **kwargs)
            count("queued")
            return future

        def held_when_long(request: Any, *args: Any, **kwargs: Any) -> Any:
            if len(str(request.body.get("prompt", ""))) >= LONG_CHARS:
                count("held")  # on the tokenizer thread, held as a long tokenization holds it
                release.wait(HOLD_S)
            return prepare(request, *args, **kwargs)

        monkeypatch.setattr(backend._tokenizers, "submit", queue_long)
        monkeypatch.setattr(backend, "prepare", held_when_long)

        def wait_for_a_full_lane() -> None:
            """What the test relies on: every long-lane thread holds a long prompt, the rest wait."""
            full = {"queued": LONG_REQUESTS, "held": TOKENIZER_THREADS}
            with changed:
                assert changed.wait_for(lambda: lane == full, timeout=HOLD_S), f"long lane: {lane}, not {full}"

        async def load() -> list[int]:
            async with httpx.AsyncClient(base_url=server.v1, timeout=HOLD_S) as client:
                long_body = {"model": MODEL, "prompt": "word " * (LONG_CHARS // 5), "max_tokens": 1}
                longs = [asyncio.create_task(client.post("/completions", json=long_body))
                         for _ in range(LONG_REQUESTS)]
                try:
                    await asyncio.to_thread(wait_for_a_full_lane)
                    try:
                        short = await client.post("/completions", timeout=SHORT_TIMEOUT_S,
                                                  json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                    except httpx.TimeoutException:
                        pytest.fail(f"the short request waited {SHORT_TIMEOUT_S} s behind the long prompts")
                    assert short.status_code == 200, short.text
                    # Not one more in the long lane: the short one took the other.
                    assert lane == {"queued": LONG_REQUESTS, "held": TOKENIZER_THREADS}
                finally:
                    release.set()
                return [r.status_code for r in await asyncio.gather(*longs)]

        # The long ones are answered too (here: too long for the context).
        assert len(asyncio.run(load())) == LONG_REQUESTS
