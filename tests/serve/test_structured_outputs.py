"""Structured outputs on the server: OpenAI's `response_format` and vLLM's fields, live, streamed
and in the Batch API; every answer parses, and a bad setting is a 400 naming its field."""

from __future__ import annotations

import io
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.serve.conftest import MODEL, Running
from tests.serve.test_batches import client_for, wait_for
from tests.serve.test_odd_values import batch_of
from tokenmill.openai_compat import CHAT_URL

REVIEW = [{"role": "user", "content": "Is this review positive or negative? 'The kettle broke after a week.'"}]
LABELS = ["positive", "negative"]
SCHEMA = {  # short answers: the CPU engine does a few tokens a second here
    "type": "object",
    "properties": {"label": {"enum": LABELS}, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["label", "stars"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def test_a_json_schema_answer_parses_and_validates(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=REVIEW, max_tokens=30, temperature=0,
                                         response_format=RESPONSE_FORMAT)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_vllm_fields_choice_regex_and_sampled_json(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=REVIEW, max_tokens=8, temperature=0,
                                          extra_body={"structured_outputs": {"choice": LABELS}})
    assert chat.choices[0].message.content in LABELS and chat.choices[0].finish_reason == "stop"
    older = client.completions.create(model=MODEL, prompt="The review 'I love it' is", max_tokens=8,
                                      temperature=1.0, seed=3, extra_body={"guided_choice": LABELS})
    assert older.choices[0].text in LABELS
    digits = client.completions.create(model=MODEL, prompt="Three digits:", max_tokens=8, temperature=1.0, seed=5,
                                       extra_body={"guided_regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", digits.choices[0].text) and digits.choices[0].finish_reason == "stop"
    stars = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
             "required": ["stars"], "additionalProperties": False}
    sampled = client.completions.create(model=MODEL, prompt="Rate it:", max_tokens=12, temperature=1.0, seed=7,
                                        extra_body={"guided_json": stars})
    jsonschema.validate(json.loads(sampled.choices[0].text), stars)


def test_streamed_chunks_concatenate_to_the_same_valid_json(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=REVIEW, max_tokens=30, temperature=0,
                                                 response_format=RESPONSE_FORMAT, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"
    whole = client.chat.completions.create(model=MODEL, messages=REVIEW, max_tokens=30, temperature=0,
                                           response_format=RESPONSE_FORMAT)
    assert text == whole.choices[0].message.content


def test_max_tokens_cuts_a_json_answer_with_length(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=REVIEW, max_tokens=3, temperature=0,
                                         response_format=RESPONSE_FORMAT)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize(("fields", "param", "words"), [
    # checked by the engine's compiler
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "format": "credit-card"}}}},
     "response_format", "body.response_format.json_schema.schema: Unknown format: credit-card"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "body.response_format.json_schema.schema: "),
    ({"guided_regex": "a(("}, "guided_regex", "body.guided_regex: "),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "body.structured_outputs.grammar: "),
    ({"guided_json": "{not json"}, "guided_json", "body.guided_json: "),
    # checked by openai_compat, in the words a batch line gets (not pydantic's)
    ({"structured_outputs": {"choice": []}}, "structured_outputs",
     "body.structured_outputs.choice must be a non-empty list of non-empty strings, got []"),
    ({"guided_choice": []}, "guided_choice", "body.guided_choice must be a non-empty list of non-empty strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "body.guided_choice must be a non-empty list of non-empty strings"),
    ({"guided_regex": ""}, "guided_regex", "body.guided_regex must be a non-empty string"),
    ({"guided_json": 5}, "guided_json", "body.guided_json must be a JSON schema (an object), got int"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs",
     "body.structured_outputs needs exactly one of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "body.structured_outputs.structural_tag is not supported by tokenmill"),
    ({"response_format": {"type": "json_object"}, "guided_choice": LABELS}, "response_format",
     "body.response_format and body.guided_choice both ask for a structured output: give one"),
    ({"response_format": {"type": "xml"}}, "response_format",
     'body.response_format must be an object with a "type" of text, json_object, json_schema, got {"type": "xml"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "body.response_format.json_schema.schema must be a JSON schema (an object), got null"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}}, "response_format",
     "body.response_format.json_schema.name must be a string, got 5"),
])
def test_a_bad_setting_is_a_400_naming_its_field(server: Running, fields: dict[str, Any], param: str,
                                                 words: str) -> None:
    body = {"model": MODEL, "messages": REVIEW, "max_tokens": 4, **fields}
    response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error


# Checked once, by openai_compat, whichever way the body comes: the same words live and in a batch.
SAME_REFUSALS = [
    {"response_format": {"type": "json_schema"}},
    {"structured_outputs": {"json": {}, "regex": "a"}},
    {"structured_outputs": {"whitespace_pattern": " "}},
    {"guided_choice": ["a", 1]},
    {"response_format": {"type": "json_object"}, "guided_regex": "a"},
    {"guided_regex": "a(("},  # the engine's compiler
]


def test_a_bad_setting_gets_the_same_message_live_and_as_a_batch_line(server: Running) -> None:
    bodies = {f"bad-{i}": {"model": MODEL, "messages": REVIEW, "max_tokens": 4, **fields}
              for i, fields in enumerate(SAME_REFUSALS)}
    live = {}
    for (custom_id, body), fields in zip(bodies.items(), SAME_REFUSALS, strict=True):
        response = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        live[custom_id] = response.json()["error"]
        assert live[custom_id]["param"] == next(iter(fields)), live[custom_id]  # the first field at fault
    good = {"model": MODEL, "messages": REVIEW, "max_tokens": 1}
    done, results, errors = batch_of(client_for(server), CHAT_URL, {**bodies, "good": good})
    assert done.status == "completed" and results == {"good"} and errors.keys() == bodies.keys(), done
    for line, custom_id in enumerate(bodies, start=1):
        assert errors[custom_id]["message"] == f"line {line}: {live[custom_id]['message']}", custom_id


def test_a_batch_of_response_format_lines(server: Running) -> None:
    def line(custom_id: str, **fields: Any) -> bytes:
        body = {"model": MODEL, "messages": REVIEW, "max_tokens": 30, "temperature": 0, **fields}
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": body}).encode() + b"\n"

    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    data = (line("json", response_format=RESPONSE_FORMAT) + line("choice", guided_choice=LABELS)
            + line("bad", response_format=bad_schema))
    client = client_for(server)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id, lambda b: b.status in ("completed", "failed"), timeout=120)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    results = {r["custom_id"]: r["response"]["body"]["choices"][0]
               for r in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    jsonschema.validate(json.loads(results["json"]["message"]["content"]), SCHEMA)
    assert results["choice"]["message"]["content"] in LABELS
    [error] = map(json.loads, client.files.content(done.error_file_id).text.splitlines())
    assert error["custom_id"] == "bad" and "body.response_format.json_schema.schema: " in error["error"]["message"]
