"""The demo's ground truth (examples/reviews.labels.jsonl) and its scorer (examples/score_labels.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import jsonschema
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    """An example script as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result_row(custom_id: str, content: str) -> dict:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
    return {"custom_id": custom_id, "response": {"status_code": 200, "body": body}, "error": None}


def test_the_label_files_are_what_the_generator_writes() -> None:
    reviews = load("make_reviews")
    count = len((EXAMPLES / "reviews.jsonl").read_text().splitlines())
    labels = [json.loads(line) for line in (EXAMPLES / "reviews.labels.jsonl").read_text().splitlines()]
    requests = [json.loads(line) for line in (EXAMPLES / "reviews.jsonl").read_text().splitlines()]
    assert labels == [reviews.label_line(i) for i in range(count)]  # regenerate both after editing fragments
    assert [row["custom_id"] for row in labels] == [row["custom_id"] for row in requests]
    assert {row["label"] for row in labels} == {"positive", "negative", "mixed"}
    # The label is the sentiment of the fragments the review text was made of.
    assert all(requests[i]["body"]["messages"][-1]["content"] == reviews.review(i)[1] for i in range(count))


def test_the_answer_schema_allows_exactly_the_labels() -> None:
    schema = json.loads((EXAMPLES / "review_schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"label": "mixed", "summary": "great screen, weak battery"})
    assert not validator.is_valid({"label": "neutral", "summary": "fine"})
    assert not validator.is_valid({"label": "mixed"})
    assert not validator.is_valid({"label": "mixed", "summary": "x", "score": 3})


@pytest.mark.parametrize(("text", "label"), [
    ("positive | great sound, easy pairing", "positive"),  # free text: the first word
    ("Negative: strap broke", "negative"),
    ('{"label":"mixed","summary":"great screen, battery dies"}', "mixed"),  # JSON: its "label"
    ('{"label":"mixed","summ', None),  # JSON cut by max_tokens
    ('{"summary":"no label"}', None),
    ("mixed", "mixed"),  # choice: the whole answer
    ("", None),
])
def test_extract_label(text: str, label: str | None) -> None:
    assert load("score_labels").extract_label(text) == label


def test_score(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({"custom_id": f"r{i}", "label": label}) + "\n"
                              for i, label in enumerate(["positive", "negative", "mixed", "mixed", "positive"])))
    rows = [result_row("r2", '{"label":"mixed","summary":"ok"}'), result_row("r0", "positive | good"),
            result_row("r1", "great | not a label"), result_row("r3", '{"label":"mi'),
            {"custom_id": "r4", "response": None, "error": {"code": "bad_request", "message": "too long"}}]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(row) + "\n" for row in rows))
    load("score_labels").main(str(results), str(labels))
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "2/5 correct (40.0%); 2 answers did not parse; 1 with no answer"
