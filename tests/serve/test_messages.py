"""Refusals that say what is wrong in the user's terms, in OpenAI's error shape with a code: the
count of stop strings, a JSON body sent as text, a body nested too deep to parse."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MODEL, Running
from tokenmill.openai_compat import MAX_STOP_SEQUENCES

JSON = {"content-type": "application/json"}


def error_of(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def test_too_many_stop_strings_names_the_count(server: Running) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop": ["x"] * (MAX_STOP_SEQUENCES + 1)}
    for route, extra in (("completions", {}), ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        error = error_of(httpx.post(f"{server.v1}/{route}", json={**body, **extra}))
        assert error == {  # the words a batch line gets (openai_compat.SAMPLING_FIELDS), not pydantic's
            "message": f"body.stop: at most {MAX_STOP_SEQUENCES} items, got {MAX_STOP_SEQUENCES + 1}",
            "type": "invalid_request_error", "param": "stop", "code": "array_above_max_length"}, route
    item = error_of(httpx.post(f"{server.v1}/completions", json={**body, "stop": ["x", 1]}))
    assert (item["param"], item["message"]) == ("stop", "body.stop[1] must be a non-empty string, got 1")
    empty = error_of(httpx.post(f"{server.v1}/chat/completions", json={"model": MODEL, "messages": []}))
    assert (empty["param"], empty["code"], empty["message"]) == (
        "messages", "empty_array", "messages: an empty list; at least 1 item(s)")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_json_body_not_sent_as_json_says_the_content_type(server: Running, content_type: str | None) -> None:
    raw = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    headers = {"content-type": content_type} if content_type else {}
    error = error_of(httpx.post(f"{server.v1}/completions", content=raw, headers=headers), status=415)
    assert error["code"] == "unsupported_media_type" and error["param"] is None
    assert "must be JSON, sent with 'Content-Type: application/json'" in error["message"]
    assert (f"says {content_type!r}" if content_type else "has none") in error["message"]
    assert "valid dictionary" not in error["message"]


def test_a_body_nested_too_deep_is_refused_by_name(server: Running) -> None:
    deep = f'{{"model": "{MODEL}", "prompt": {"[" * 100_000}"x"{"]" * 100_000}}}'
    error = error_of(httpx.post(f"{server.v1}/completions", content=deep, headers=JSON))
    assert error["code"] == "invalid_json" and "nests arrays or objects deeper than" in error["message"]
    ok = httpx.post(f"{server.v1}/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200  # the server goes on
