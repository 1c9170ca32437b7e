"""Odd values in every field the completion routes read — a lone surrogate, a NUL, numbers, an
object, null where text belongs — sent live and as Batch API lines. Nothing is a 500 or fails a
batch: a value the server cannot serve is a 400 naming its field live, and one error row in a batch
whose other lines complete; a NUL is a character like any other. Live and batch give one body the
same answer."""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, Running
from tests.serve.test_batches import client_for, jsonl, wait_for
from tokenmill.openai_compat import CHAT_URL, COMPLETIONS_URL

SURROGATE = "a\udfffb"  # what the JSON text "a\\udfffb" reads as: half of a UTF-16 pair, no character
NUL = "a\x00b"
ODD_VALUES = (SURROGATE, NUL, 5, True, {}, None)  # the last four where a field takes text
HERE = "<the odd value>"
LIVE_CLIENTS = 16


@dataclass(frozen=True)
class Field:
    """A body fragment with HERE where the odd value goes."""

    fragment: dict[str, Any]
    # The field takes text (or its own type) only: a number or an object there is refused. A loose
    # one takes any JSON value, so it gets fewer of them.
    strict: bool = True
    # A batch line answers as a live request does. Not so for a prompt in a list: live, a list
    # holding one prompt is that prompt (as OpenAI's clients send it); a batch line is one prompt.
    like_live: bool = True

    @property
    def values(self) -> tuple[Any, ...]:
        return ODD_VALUES if self.strict else (SURROGATE, NUL, 5)


BOTH_ROUTES = [
    Field({"model": HERE}),
    Field({"stop": HERE}),
    Field({"stop": ["x", HERE]}),
    Field({"structured_outputs": {"choice": ["yes", HERE]}}),
    Field({"structured_outputs": {"regex": HERE}}),
    Field({"structured_outputs": {"grammar": HERE}}),
    Field({"structured_outputs": {"json": {"type": "string", "enum": [HERE]}}}, strict=False),
    Field({"guided_choice": [HERE]}),
    Field({"guided_regex": HERE}),
    Field({"guided_grammar": HERE}),
    Field({"response_format": {"type": HERE}}),
    Field({"response_format": {"type": "json_schema", "json_schema": {"name": HERE, "schema": {"type": "string"}}}}),
    Field({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": HERE}}}}),
    Field({"user": HERE}, strict=False),  # ignored live, whatever it holds, unless it is no text
    Field({"an_unknown_field": HERE}, strict=False),
]
ROUTE_FIELDS = {
    COMPLETIONS_URL: [Field({"prompt": HERE}), Field({"prompt": [HERE]}, strict=False, like_live=False)],
    CHAT_URL: [
        Field({"messages": [{"role": "user", "content": HERE}]}),
        Field({"messages": [{"role": HERE, "content": "Hello"}]}),
        Field({"messages": [{"role": "user", "content": [{"type": "text", "text": HERE}]}]}),
        Field({"messages": [{"role": "user", "content": "Hello", "name": HERE}]}, strict=False),
        Field({"chat_template_kwargs": {"x": HERE}}, strict=False),
    ],
}
BASE = {
    COMPLETIONS_URL: {"model": MODEL, "prompt": "Hello", "max_tokens": 1},
    CHAT_URL: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
}
# A live request must name the model; a batch line may leave it out (the batch is for the one served).
REQUIRED_LIVE_ONLY = {("model",)}


@dataclass(frozen=True, eq=False)  # one case is one request: keyed by identity
class Case:
    url: str
    body: dict[str, Any]
    path: tuple[str | int, ...]  # where the odd value is
    value: Any
    field: Field

    @property
    def where(self) -> str:
        """The path as a message names it: body.messages[0].content."""
        return "body" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path)

    @property
    def must_be_refused(self) -> bool:
        """Text that is no text, or no text where only text goes (null may just mean "not given")."""
        return self.value == SURROGATE or (self.field.strict and self.value is not None and self.value != NUL)

    @property
    def like_live(self) -> bool:
        """Whether a batch line answers this as a live request does."""
        return self.field.like_live and not (self.value is None and self.path in REQUIRED_LIVE_ONLY)


def filled(fragment: Any, value: Any, path: tuple[str | int, ...] = ()) -> tuple[Any, tuple[str | int, ...] | None]:
    """`fragment` with HERE replaced by `value`, and where HERE was."""
    if fragment == HERE:
        return value, path
    if not isinstance(fragment, (dict, list)):
        return fragment, None
    out, found = {}, None
    for key, item in fragment.items() if isinstance(fragment, dict) else enumerate(fragment):
        out[key], where = filled(item, value, (*path, key))
        found = found or where
    return (out if isinstance(fragment, dict) else list(out.values())), found


def cases() -> Iterator[Case]:
    for url, fields in ROUTE_FIELDS.items():
        for field in BOTH_ROUTES + fields:
            for value in field.values:
                body, path = filled(field.fragment, value)
                assert path is not None
                yield Case(url, {**BASE[url], **body}, path, value, field)


def as_sent(value: Any) -> bytes:
    """JSON as a client sends it: a lone surrogate as its \\u escape (it has no UTF-8 form)."""
    return json.dumps(value).encode()


def post(client: httpx.Client, case: Case) -> httpx.Response:
    return client.post(case.url, content=as_sent(case.body), headers={"Content-Type": "application/json"})


def test_odd_values_are_refused_naming_the_field_live_and_in_a_batch(server: Running) -> None:
    all_cases = list(cases())
    # Side by side, as clients send them: the engine runs the accepted ones in one batch.
    with httpx.Client(base_url=server.url, timeout=60) as http, ThreadPoolExecutor(LIVE_CLIENTS) as pool:
        responses = list(pool.map(functools.partial(post, http), all_cases))
    live = {}
    for case, response in zip(all_cases, responses, strict=True):
        label = (case.url, case.where, ascii(case.value))
        live[case] = response.status_code
        assert response.status_code in (200, 400, 404), (label, response.text)  # 404: a model it does not serve
        if case.must_be_refused:
            assert response.status_code in (400, 404), (label, response.text)
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["param"] == case.path[0] and str(case.path[0]) in error["message"], (label, error)
        if case.value == SURROGATE:
            assert response.status_code == 400, (label, response.text)
            assert f"{case.where} holds a lone surrogate" in response.json()["error"]["message"], label

    client = client_for(server)
    for url in ROUTE_FIELDS:
        batch_cases = [case for case in all_cases if case.url == url]
        rows = [
            {"custom_id": f"case-{i}", "method": "POST", "url": url, "body": case.body}
            for i, case in enumerate(batch_cases)
        ]
        rows.append({"custom_id": "good", "method": "POST", "url": url, "body": BASE[url]})
        upload = client.files.create(
            file=("odd.jsonl", io.BytesIO(b"".join(as_sent(r) + b"\n" for r in rows))), purpose="batch"
        )
        batch = client.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
        done = wait_for(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
        assert done.status == "completed", done
        results = {row["custom_id"] for row in jsonl(client, done.output_file_id)}
        errors = {row["custom_id"]: row["error"] for row in jsonl(client, done.error_file_id)}
        assert len(results) + len(errors) == len(rows) and not results & errors.keys()  # each line once
        assert "good" in results
        for i, case in enumerate(batch_cases):
            label = (case.url, case.where, ascii(case.value), live[case])
            if f"case-{i}" in errors:
                error = errors[f"case-{i}"]
                assert error["code"] == "invalid_input" and str(case.path[0]) in error["message"], (label, error)
            if not case.like_live:
                continue
            assert (f"case-{i}" in results) == (live[case] == 200), label  # the answer it had live
            if case.value == SURROGATE:
                assert f"{case.where} holds a lone surrogate" in errors[f"case-{i}"]["message"], label


POISON = "the one prompt the tokenizer fails on"


def batch_of(client: openai.OpenAI, url: str, bodies: dict[str, dict[str, Any]]) -> tuple[Any, set[str], dict]:
    """Run a batch of these bodies (by custom_id): the batch, the ids with a result, the error rows' errors."""
    rows = [{"custom_id": custom_id, "method": "POST", "url": url, "body": body} for custom_id, body in bodies.items()]
    upload = client.files.create(
        file=("in.jsonl", io.BytesIO(b"".join(as_sent(r) + b"\n" for r in rows))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h")
    done = wait_for(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
    results = {row["custom_id"] for row in jsonl(client, done.output_file_id)}
    return done, results, {row["custom_id"]: row["error"] for row in jsonl(client, done.error_file_id)}


def test_whatever_preparing_one_request_raises_is_that_requests_refusal(
    server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure no check foresaw (the tokenizer raising on one prompt, as it did on a lone surrogate
    before those were looked for) refuses that request alone: a 400 live, not a 500 a client
    retries; an error row in a batch, whose other lines complete."""
    engine = server.state.llm.engine
    process_request = engine.process_request

    def failing_on_poison(prompt: Any, *args: Any, **kwargs: Any) -> Any:
        if prompt == POISON:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return process_request(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "process_request", failing_on_poison)
    response = httpx.post(f"{server.v1}/completions", json={**BASE[COMPLETIONS_URL], "prompt": POISON}, timeout=60)
    assert response.status_code == 400, response.text
    assert "TypeError" in response.json()["error"]["message"]

    bodies = {
        "before": BASE[COMPLETIONS_URL],
        "poison": {**BASE[COMPLETIONS_URL], "prompt": POISON},
        "after": {**BASE[COMPLETIONS_URL], "prompt": "Goodbye"},
    }
    done, results, errors = batch_of(client_for(server), COMPLETIONS_URL, bodies)
    assert done.status == "completed", done
    assert results == {"before", "after"} and errors.keys() == {"poison"}
    assert errors["poison"]["code"] == "invalid_request" and "TypeError" in errors["poison"]["message"]


def test_a_request_the_engine_fails_to_add_fails_alone(server: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's thread outlives a request it could not take: that one is a 500, the server
    goes on serving (it used to die there, every later request waiting for ever)."""
    engine = server.state.llm.engine
    add_processed = engine.add_processed

    def failing_on_poison(request: Any) -> Any:
        if request.prompt == POISON:
            raise RuntimeError("no room for it")
        return add_processed(request)

    monkeypatch.setattr(engine, "add_processed", failing_on_poison)
    with httpx.Client(base_url=server.v1, timeout=30) as http:
        response = http.post("/completions", json={**BASE[COMPLETIONS_URL], "prompt": POISON})
        assert response.status_code == 500 and response.json()["error"]["type"] == "server_error", response.text
        assert "no room for it" in response.json()["error"]["message"]
        assert http.post("/completions", json=BASE[COMPLETIONS_URL]).status_code == 200
    assert server.state.loop.alive


def test_an_id_that_is_not_text_or_repeats_is_one_error_row(server: Running) -> None:
    """Every line of a batch ends in exactly one row: a custom_id holding a lone surrogate (no row
    could be written with it) and a repeated custom_id are error rows, the batch completes."""
    client = client_for(server)
    body = BASE[COMPLETIONS_URL]
    ids = ["first", SURROGATE, "dup", "dup", "last"]
    rows = [{"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL, "body": body} for custom_id in ids]
    upload = client.files.create(
        file=("in.jsonl", io.BytesIO(b"".join(as_sent(r) + b"\n" for r in rows))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=upload.id, endpoint=COMPLETIONS_URL, completion_window="24h")
    done = wait_for(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
    assert done.status == "completed", done
    results, errors = jsonl(client, done.output_file_id), jsonl(client, done.error_file_id)
    assert sorted(row["custom_id"] for row in results) == ["dup", "first", "last"]
    assert [(row["custom_id"], row["error"]["code"]) for row in errors] == [
        (None, "invalid_input"), ("dup", "invalid_input")]
    assert errors[0]["error"]["message"].startswith('line 2: "custom_id" holds a lone surrogate (\\udfff at')
    assert errors[1]["error"]["message"] == 'line 4: duplicate custom_id "dup" (first seen on line 3)'
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
