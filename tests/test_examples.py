"""The demo's ground truth (examples/reviews.labels.jsonl) and its answer schema (examples/review_schema.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import jsonschema

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str) -> ModuleType:
    """An example script as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
