"""Input validation: every bad line reported by number and field; the three input forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.jobs.backends.embedded import EmbeddedBackend
from tokenmill.jobs.input.reader import read_input
from tokenmill.jobs.input.request import DocumentOptions

from .conftest import batch_line, write_jsonl


def errors_of(path: Path, options: DocumentOptions | None = None, **kw) -> list[str]:
    return [e.message for e in read_input(path, options or DocumentOptions(), **kw).errors]


def test_every_bad_batch_line_is_reported_by_number(tmp_path: Path) -> None:
    good = batch_line("r-1", "hello")
    no_id = {k: v for k, v in batch_line("x", "hi").items() if k != "custom_id"}
    rows = [
        good,                                                        # 1
        batch_line("r-2", "fine"),                                   # 2
        {**batch_line("r-3", "x"), "url": "/v1/responses"},          # 3
        '{"custom_id": "r-4" "url": 1}',                             # 4
        [1, 2],                                                      # 5
        {**batch_line("r-6", "x"), "method": "GET"},                 # 6
        no_id,                                                       # 7
        {"custom_id": "r-8", "url": "/v1/chat/completions"},         # 8
        batch_line("r-1", "again"),                                  # 9
        {"custom_id": "r-10", "url": "/v1/completions", "body": {}},  # 10
        {"custom_id": "r-11", "url": "/v1/chat/completions", "body": {"messages": []}},  # 11
        batch_line("r-12", "x", max_tokens=0),                       # 12
        batch_line("r-13", "x", temperature=-1),                     # 13
        {"custom_id": 14, "url": "/v1/completions", "body": {"prompt": "x"}},  # 14
        {"custom_id": "r-15", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},  # 15
        {"custom_id": "r-16", "url": "/v1/chat/completions", "body": "hi"},  # 16
        {"custom_id": "r-17", "url": "/v1/chat/completions", "body": {"messages": [{"content": "x"}]}},  # 17
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    with path.open("ab") as f:
        f.write(b'{"custom_id": "r-18", "url": "/v1/completions", "body": {"prompt": "\xff"}}\n')  # 18
    spec = read_input(path, DocumentOptions())
    assert spec.format == "batch"
    assert [e.custom_id for e in spec.entries] == ["r-1", "r-2"]
    assert [e.message for e in spec.errors] == [
        'line 3: unknown url "/v1/responses" (supported: /v1/chat/completions, /v1/completions, /v1/embeddings)',
        "line 4: not JSON (Expecting ',' delimiter at column 21)",
        "line 5: expected a JSON object, got a list",
        'line 6: method "GET" is not supported (only "POST")',
        'line 7: missing field "custom_id"',
        'line 8: missing field "body"',
        'line 9: duplicate custom_id "r-1" (first seen on line 1)',
        'line 10: missing field "body.prompt"',
        "line 11: body.messages must be a non-empty list, got []",
        "line 12: body.max_tokens must be >= 1, got 0",
        "line 13: body.temperature must be in [0, 2], got -1",
        'line 14: "custom_id" must be a non-empty string, got 14',
        "line 15: body.prompt must be one string or a list of token ids (one prompt per line)",
        'line 16: "body" must be a JSON object, got a string',
        'line 17: body.messages[0] must be an object with a "role"',
        "line 18: not UTF-8 (invalid start byte at byte 68)",
    ]
    assert spec.errors[6].custom_id == "r-1" and spec.errors[4].custom_id is None
    assert spec.num_lines == 18


def test_values_are_refused_by_type_and_range_not_coerced(tmp_path: Path) -> None:
    """Whatever backend runs it: a string "5", true, Infinity, 1,000 stop strings, a negative token
    id or a seed past 64 bits is refused by name; and a cut-off line says where it broke."""
    rows = [
        batch_line("ok", "x", max_tokens=5, temperature=2, stop=["a"] * 16, seed=2**64 - 1),
        batch_line("str", "x", max_tokens="5"),
        batch_line("bool", "x", max_tokens=True),
        '{"custom_id": "inf", "url": "/v1/completions", "body": {"prompt": "x", "temperature": Infinity}}',
        batch_line("stops", "x", stop=["s"] * 1000),
        batch_line("ids", "x", stop_token_ids=[-1]),
        batch_line("seed", "x", seed=2**80),
        '{"custom_id": "cut", "url": "/v1/completions", "body": {"prompt": "x"',
    ]
    spec = read_input(write_jsonl(tmp_path / "in.jsonl", rows), DocumentOptions())
    assert [e.custom_id for e in spec.entries] == ["ok"]
    assert [e.message for e in spec.errors] == [
        'line 2: body.max_tokens must be an integer, got "5"',
        "line 3: body.max_tokens must be an integer, got true",
        "line 4: body.temperature must be a finite number, got Infinity",
        "line 5: body.stop: at most 16 items, got 1000",
        "line 6: body.stop_token_ids must be a list of token ids (integers >= 0), got [-1]",
        f"line 7: body.seed must be in [{-(2**63)}, {2**64 - 1}], got {2**80}",
        "line 8: not JSON (Expecting ',' delimiter at the end of the line)",
    ]


def test_blank_lines_are_skipped_and_lines_keep_their_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(batch_line("a", "x")) + "\n\n   \n" + '{"custom_id": "b"}\n')
    assert errors_of(path) == ['line 4: missing field "url"']


def test_simple_jsonl_prompt_and_messages(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "prompt": "Great kettle."},
        {"prompt": "No id here."},
        {"id": 7, "messages": [{"role": "user", "content": "hi"}]},
        {"id": "d", "prompt": "x", "messages": []},
        {"id": "e"},
        {"id": "a", "prompt": "dup"},
        {"id": "g", "prompt": ""},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    options = DocumentOptions(system="Classify.", template="Review: {text}", max_tokens=5, temperature=0)
    spec = read_input(path, options)
    assert spec.format == "jsonl"
    assert [e.custom_id for e in spec.entries] == ["a", "line-2", "7"]
    assert [e.message for e in spec.errors] == [
        'line 4: has both "prompt" and "messages": give one',
        'line 5: missing field "prompt" (or "messages")',
        'line 6: duplicate custom_id "a" (first seen on line 1)',
        'line 7: "prompt" must be a non-empty string, got ""',
    ]
    first, _, third = spec.requests(spec.entries)
    assert first.body == {
        "messages": [{"role": "system", "content": "Classify."}, {"role": "user", "content": "Review: Great kettle."}],
        "max_tokens": 5, "temperature": 0,
    }
    assert third.body["messages"][0] == {"role": "system", "content": "Classify."}


def test_text_file_one_document_a_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("The lid broke.\n\n{not json, just a document}\nLove it.\n")
    spec = read_input(path, DocumentOptions(completions=True, template="Sentiment of: {text}\nAnswer:"))
    assert spec.format == "text" and not spec.errors
    requests = list(spec.requests(spec.entries))
    assert [r.custom_id for r in requests] == ["line-1", "line-3", "line-4"]
    assert requests[1].url == "/v1/completions"
    assert requests[1].body["prompt"] == "Sentiment of: {not json, just a document}\nAnswer:"


def test_options_fill_bodies_but_do_not_override_them(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x", max_tokens=3), batch_line("b", "y")])
    spec = read_input(path, DocumentOptions(max_tokens=9, temperature=0.5, model="served-model"))
    a, b = spec.requests(spec.entries)
    assert a.body["max_tokens"] == 3 and b.body["max_tokens"] == 9
    assert a.body["model"] == b.body["model"] == "served-model"
    assert a.body["temperature"] == 0.5


def test_logprobs_fill_each_body_in_its_own_words(tmp_path: Path) -> None:
    rows = [batch_line("chat", "x"), batch_line("text", "x", url="/v1/completions"),
            batch_line("own", "x", logprobs=False), batch_line("own-top", "x", logprobs=True, top_logprobs=1),
            batch_line("own-text", "x", url="/v1/completions", logprobs=0)]
    spec = read_input(write_jsonl(tmp_path / "in.jsonl", rows), DocumentOptions(logprobs=3))
    assert not spec.errors
    bodies = {r.custom_id: r.body for r in spec.requests(spec.entries)}
    asked = {name: {k: body.get(k) for k in ("logprobs", "top_logprobs")} for name, body in bodies.items()}
    assert asked == {
        "chat": {"logprobs": True, "top_logprobs": 3},
        "text": {"logprobs": 3, "top_logprobs": None},
        "own": {"logprobs": False, "top_logprobs": None},  # a body that says what it wants keeps it
        "own-top": {"logprobs": True, "top_logprobs": 1},
        "own-text": {"logprobs": 0, "top_logprobs": None},
    }
    # Above /v1/completions' 5, a completions line is refused naming the field; chat takes up to 20.
    many = read_input(write_jsonl(tmp_path / "many.jsonl", rows[:2]), DocumentOptions(logprobs=20))
    assert [e.message for e in many.errors] == ["line 2: body.logprobs must be in [0, 5], got 20"]


def test_logprobs_join_the_fingerprint_only_when_set() -> None:
    assert "logprobs" not in DocumentOptions().fingerprint()  # a job from before the option still resumes
    assert DocumentOptions(logprobs=0).fingerprint()["logprobs"] == 0
    assert DocumentOptions(logprobs=2).fingerprint() != DocumentOptions(logprobs=3).fingerprint()


def test_format_detection_and_forcing(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.data", [{"prompt": "x"}])
    assert read_input(path, DocumentOptions()).format == "jsonl"
    forced = read_input(path, DocumentOptions(), input_format="text")
    assert forced.format == "text" and not forced.errors
    plain = tmp_path / "plain"
    plain.write_text("just words\n")
    assert read_input(plain, DocumentOptions()).format == "text"


JUNK = ["{ this was cut off", "and this is no JSON at all"]  # a torn first record, or a stray note


@pytest.mark.parametrize("name", ["in.jsonl", "in.ndjson", "in.JSONL", "no-suffix"])
def test_junk_first_lines_of_json_lines_are_bad_lines_not_text(tmp_path: Path, name: str) -> None:
    path = write_jsonl(tmp_path / name, [*JUNK, batch_line("a", "x"), batch_line("b", "y")])
    spec = read_input(path, DocumentOptions())
    assert spec.format == "batch"
    assert [e.custom_id for e in spec.entries] == ["a", "b"]
    assert [e.line for e in spec.errors] == [1, 2]


def test_a_jsonl_is_never_text_and_a_first_object_that_is_no_request_decides_nothing(tmp_path: Path) -> None:
    words = write_jsonl(tmp_path / "in.jsonl", ["just words", {"prompt": "x"}])
    spec = read_input(words, DocumentOptions())
    assert spec.format == "jsonl" and [e.line for e in spec.errors] == [1] and len(spec.entries) == 1
    noted = write_jsonl(tmp_path / "noted.jsonl", [{"note": "exported 2026-12-01"}, batch_line("a", "x")])
    assert read_input(noted, DocumentOptions()).format == "batch"
    assert read_input(write_jsonl(tmp_path / "in.txt", [batch_line("a", "x")]), DocumentOptions()).format == "text"


def test_sha256_covers_the_whole_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "x")])
    first = read_input(path, DocumentOptions()).sha256
    path.write_text(path.read_text() + "\n")
    assert read_input(path, DocumentOptions()).sha256 != first


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\{text\}"):
        DocumentOptions(template="no placeholder")
    with pytest.raises(ValueError, match="max_tokens must be positive, got 0"):
        DocumentOptions(max_tokens=0)
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\], got 21"):
        DocumentOptions(logprobs=21)
    with pytest.raises(ValueError, match="logprobs 6 with completions: /v1/completions takes at most 5"):
        DocumentOptions(logprobs=6, completions=True)


def test_embedded_backend_rules_are_checked_up_front(tmp_path: Path) -> None:
    rows = [
        batch_line("ok", "x", top_k=-1),
        batch_line("n", "x", n=2),
        batch_line("tools", "x", tools=[{"type": "function"}]),
        batch_line("top_p", "x", top_p=2),
        {"custom_id": "img", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}},
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    backend = EmbeddedBackend(load_to_check=False)  # the body rules alone: no model loaded
    assert errors_of(path, check=backend.check) == [
        "line 2: body.n = 2: tokenmill returns one choice per request",
        "line 3: body.tools is not supported by tokenmill",
        "line 4: body.top_p must be in (0, 1], got 2",
        "line 5: body.messages[0]: only text content parts are supported by tokenmill",
    ]


def test_missing_input_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file or folder"):
        read_input(tmp_path / "nope.jsonl", DocumentOptions())
