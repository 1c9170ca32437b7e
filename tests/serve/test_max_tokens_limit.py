"""`tokenmill serve --max-tokens-limit N`: a request asking for more than N tokens is refused with a
400 naming the limit, live or as a Batch API line; one asking for none gets the default held to N."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, serving
from tokenmill.cli import build_parser
from tokenmill.engine.llm import LLM
from tokenmill.serve import cli

LIMIT = 6


def test_requests_over_the_limit_are_refused_naming_it(serve_llm: LLM, tmp_path: Path) -> None:
    with serving(serve_llm, tmp_path, max_tokens_limit=LIMIT) as server:
        for route, body in (("completions", {"prompt": "Hi", "max_tokens": 1_000_000_000}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_completion_tokens": LIMIT + 1})):
            refused = httpx.post(f"{server.v1}/{route}", json={"model": MODEL, **body})
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            field = next(iter(set(body) & {"max_tokens", "max_completion_tokens"}))
            assert (error["type"], error["param"]) == ("invalid_request_error", field)
            assert f"over this server's limit of {LIMIT} tokens" in error["message"]
            assert "--max-tokens-limit" in error["message"]

        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        endless = {"ignore_eos": True}
        at_limit = client.completions.create(model=MODEL, prompt="Hi", max_tokens=LIMIT, extra_body=endless)
        assert at_limit.usage.completion_tokens == LIMIT
        unasked = client.completions.create(model=MODEL, prompt="Hi", extra_body=endless)
        assert (unasked.usage.completion_tokens, unasked.choices[0].finish_reason) == (LIMIT, "length")

        rows = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": "Hi", "max_tokens": tokens}}
                for name, tokens in (("within", LIMIT), ("over", LIMIT + 1))]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        batch = client.batches.create(input_file_id=client.files.create(file=("in.jsonl", io.BytesIO(data)),
                                                                          purpose="batch").id,
                                      endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.1)
        errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
        assert [e["custom_id"] for e in errors] == ["over"]
        assert f"limit of {LIMIT} tokens" in json.dumps(errors[0])


def test_the_flag_reaches_the_server_state(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class Built(Exception):
        pass

    def state(llm: object, **options: Any) -> None:
        seen.update(options)
        raise Built

    monkeypatch.setattr("tokenmill.engines.load_engine", lambda spec: SimpleNamespace(engine=SimpleNamespace(
        close=lambda: None)))
    monkeypatch.setattr("tokenmill.serve.state.ServeState", state)
    with pytest.raises(Built):
        cli.run(build_parser("serve").parse_args(["serve", "--max-tokens-limit", "64"]))
    assert seen["max_tokens_limit"] == 64
    with pytest.raises(Built):
        cli.run(build_parser("serve").parse_args(["serve"]))
    assert seen["max_tokens_limit"] is None  # no limit unless asked
    for bad in ("0", "-3", "ten"):
        with pytest.raises(SystemExit):
            build_parser("serve").parse_args(["serve", "--max-tokens-limit", bad])
