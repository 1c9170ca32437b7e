"""Row scorers: what each counts as right, the note when it is not, and every way one fails to build
or to score a row."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.choose.scorers import SCORERS, Score, ScorerError, make_scorer

LABELS = {"r1": "positive", "r2": "negative", "r3": "mixed", "r4": "very positive", "r5": "Positive."}


def score(spec: str, answer: str, expected: object, **kw: object) -> Score:
    return make_scorer(spec, {"r": expected}, **kw).score(answer, expected, "r")  # type: ignore[arg-type]


# --- make_scorer ----------------------------------------------------------------------------------


def test_an_unknown_scorer_lists_the_known_ones() -> None:
    with pytest.raises(ScorerError) as info:
        make_scorer("fuzzy", {})
    assert "'fuzzy'" in str(info.value)
    assert all(name in str(info.value) for name in SCORERS)
    assert "python:MODULE:FUNCTION" in str(info.value)


def test_judge_is_not_built_here() -> None:
    with pytest.raises(ValueError, match="judge is not a row scorer"):
        make_scorer("judge", {"r": "x"})


def test_schema_only_for_json() -> None:
    with pytest.raises(ScorerError, match="--schema only applies to the json scorer, not exact"):
        make_scorer("exact", {}, schema={"type": "object"})


def test_an_invalid_schema_is_refused() -> None:
    with pytest.raises(ScorerError, match="not a valid JSON Schema.*'objekt' is not valid"):
        make_scorer("json", {}, schema={"type": "objekt"})


def test_each_scorer_is_named_by_its_spec() -> None:
    for spec in ("exact", "label", "json", "regex", "contains"):
        assert make_scorer(spec, {"r": "x"}).name == spec


# --- exact ------------------------------------------------------------------------------------------


def test_exact() -> None:
    assert score("exact", "  Paris\n", "Paris ") == Score(1.0)
    assert score("exact", "paris", "Paris") == Score(0.0, "differs")
    assert score("exact", " 42.0 ", 42) == Score(1.0)  # a non-string compares as a JSON value
    assert score("exact", '{"b": [1, 2], "a": "X"}', {"a": "X", "b": [1, 2]}) == Score(1.0)
    assert score("exact", '{"a": "x"}', {"a": "X"}) == Score(0.0, "differs")  # strings inside stay exact
    assert score("exact", "1", True) == Score(0.0, "differs")
    assert score("exact", "forty-two", 42) == Score(0.0, "differs")


# --- label ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        ("Positive | great blender", "positive"),
        ("The review is negative.", "negative"),
        ('{"label":"mixed","summary":"mostly positive"}', "mixed"),
        ("**Mixed**", "mixed"),
        ("Very  POSITIVE!", "very positive"),  # the longest label at the earliest position
        ("It is positive, very positive even", "positive"),  # the earliest wins over the longest
        ("nonnegative, and positive", "positive"),  # whole words only
        ("I cannot tell", None),
    ],
)
def test_label_finds_the_first_known_label(answer: str, found: str | None) -> None:
    scorer = make_scorer("label", LABELS)
    assert scorer.find(answer) == found  # type: ignore[attr-defined]


def test_label_scores_against_the_rows_own_label() -> None:
    scorer = make_scorer("label", LABELS)
    assert scorer.score("Verdict: positive", "Positive.", "r5") == Score(1.0)  # expected normalised too
    assert scorer.score("**Very positive**", "very positive", "r4") == Score(1.0)
    assert scorer.score("positive", "very positive", "r4") == Score(0.0, "wrong label")
    assert scorer.score("The review is negative.", "mixed", "r3") == Score(0.0, "wrong label")
    assert scorer.score("no idea", "mixed", "r3") == Score(0.0, "no label")


def test_label_needs_string_labels() -> None:
    with pytest.raises(ScorerError, match='row "r2" is not a string'):
        make_scorer("label", {"r1": "positive", "r2": 1, "r3": ["x"]})
    with pytest.raises(ScorerError, match='row "r2" is empty'):
        make_scorer("label", {"r1": "positive", "r2": " ** "})


# --- json -------------------------------------------------------------------------------------------


def test_json_gives_credit_per_expected_field() -> None:
    expected = {"name": "Ada Lovelace", "year": 1815, "alive": False}
    answer = '{"name": "ada  lovelace", "year": 1816, "alive": false, "extra": 1}'
    result = score("json", answer, expected)
    assert result.value == pytest.approx(2 / 3)
    assert result.note == "fields differ"
    assert score("json", '{"name": "Ada Lovelace", "year": 1815, "alive": false}', expected) == Score(1.0)
    assert score("json", '{"alive": 0}', {"alive": False}) == Score(0.0, "fields differ")  # 0 is no false
    assert score("json", "[1, 2]", expected) == Score(0.0, "fields differ")


def test_json_parses_inside_a_code_fence() -> None:
    fenced = '\n```json\n{"a": 1}\n```\n'
    assert score("json", fenced, {"a": 1}) == Score(1.0)
    assert score("json", '```\n{"a": 1}\n```', {"a": 1}) == Score(1.0)
    assert score("json", 'Here: ```json {"a": 1}```', {"a": 1}) == Score(0.0, "not JSON")
    assert score("json", "{'a': 1}", {"a": 1}) == Score(0.0, "not JSON")


def test_json_schema_and_null_expected() -> None:
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    assert score("json", '{"a": 1}', None, schema=schema) == Score(1.0)  # null: parse and validate only
    assert score("json", '{"a": "1"}', None, schema=schema) == Score(0.0, "schema")
    assert score("json", '{"b": 1}', {"b": 1}, schema=schema) == Score(0.0, "schema")
    assert score("json", "[]", None) == Score(1.0)
    assert score("json", "nope", None) == Score(0.0, "not JSON")


def test_json_non_object_expected() -> None:
    assert score("json", '["A  b", 2]', ["a b", 2]) == Score(1.0)
    assert score("json", "3", 4) == Score(0.0, "differs")


# --- regex and contains -----------------------------------------------------------------------------


def test_regex() -> None:
    assert score("regex", "The answer is 42.", r"\b42\b") == Score(1.0)
    assert score("regex", "The answer is 420.", r"\b42\b") == Score(0.0, "no match")


def test_a_bad_pattern_names_its_row() -> None:
    with pytest.raises(ScorerError, match=r'row "r2" does not compile: re.error: missing \)'):
        make_scorer("regex", {"r1": "ok", "r2": "(unclosed"})
    with pytest.raises(ScorerError, match='row "r1" is not a string'):
        make_scorer("regex", {"r1": 3})
    scorer = make_scorer("regex", {"r1": "ok"})
    with pytest.raises(ScorerError, match='row "r9" does not compile'):
        scorer.score("x", "[", "r9")


def test_contains() -> None:
    assert score("contains", "The capital is\n  PARIS, France.", "paris,  france") == Score(1.0)
    assert score("contains", "It is Lyon", "Paris") == Score(0.0, "not found")
    assert score("contains", "the total: 1815 ships", 1815) == Score(1.0)
    with pytest.raises(ScorerError, match='row "r" is empty'):
        score("contains", "anything", "  ")


# --- python ---------------------------------------------------------------------------------------


SCORER_CODE = """
def ratio(answer, expected):
    return len(answer) / expected

def same(answer, expected):
    return answer == expected

def boom(answer, expected):
    return 1 / 0

def way_off(answer, expected):
    return 3

def word(answer, expected):
    return "yes"

def numpy_bool(answer, expected):
    import numpy
    return numpy.bool_(answer == expected)

not_a_function = 5
"""


@pytest.fixture
def module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"user_scorer_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(SCORER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_python_scorer_by_module(module_name: str) -> None:
    ratio = make_scorer(f"python:{module_name}:ratio", {})
    assert ratio.name == f"python:{module_name}:ratio"
    assert ratio.score("abcd", 8, "r") == Score(0.5, "scored < 1")
    assert ratio.score("abcd", 4, "r") == Score(1.0)
    same = make_scorer(f"python:{module_name}:same", {})
    assert same.score("a", "a", "r") == Score(1.0)
    assert same.score("a", "b", "r") == Score(0.0, "scored < 1")
    numpy_bool = make_scorer(f"python:{module_name}:numpy_bool", {})
    assert numpy_bool.score("a", "a", "r") == Score(1.0)
    assert numpy_bool.score("a", "b", "r") == Score(0.0, "scored < 1")


def test_python_scorer_from_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As under the `tokenmill` console script: neither "" nor the current directory on sys.path.
    (tmp_path / "cwd_scorer_mod.py").write_text(SCORER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    try:
        assert make_scorer("python:cwd_scorer_mod:same", {}).score("x", "x", "r") == Score(1.0)
        assert sys.path[0] == str(tmp_path)
    finally:
        sys.modules.pop("cwd_scorer_mod", None)


def test_python_scorer_by_path(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "my_scorer.py"
    path.parent.mkdir()
    path.write_text(SCORER_CODE)
    scorer = make_scorer(f"python:{path}:ratio", {})
    assert scorer.score("ab", 4, "r") == Score(0.5, "scored < 1")


def test_python_scorer_errors_while_scoring(module_name: str) -> None:
    with pytest.raises(ScorerError) as info:
        make_scorer(f"python:{module_name}:boom", {}).score("a", "b", "id-7")
    assert str(info.value) == (
        f'scorer python:{module_name}:boom raised on row "id-7": ZeroDivisionError: division by zero'
    )
    with pytest.raises(ScorerError, match=r'returned 3 on row "id-8": expected a bool or a number from 0 to 1'):
        make_scorer(f"python:{module_name}:way_off", {}).score("a", "b", "id-8")
    with pytest.raises(ScorerError, match=r"returned 'yes' on row \"id-9\""):
        make_scorer(f"python:{module_name}:word", {}).score("a", "b", "id-9")
    with pytest.raises(ScorerError, match="returned -0.5"):
        make_scorer(f"python:{module_name}:ratio", {}).score("ab", -4, "id-10")


def test_python_scorer_that_cannot_load(module_name: str, tmp_path: Path) -> None:
    with pytest.raises(ScorerError) as info:
        make_scorer("python:no_such_module_xyz:fn", {})
    assert str(info.value) == (
        "scorer python:no_such_module_xyz:fn: cannot import no_such_module_xyz: "
        "ModuleNotFoundError: No module named 'no_such_module_xyz'"
    )
    with pytest.raises(ScorerError, match=f"{module_name} has no function 'nope'"):
        make_scorer(f"python:{module_name}:nope", {})
    with pytest.raises(ScorerError, match="not_a_function is not callable"):
        make_scorer(f"python:{module_name}:not_a_function", {})
    with pytest.raises(ScorerError, match="expected python:MODULE:FUNCTION"):
        make_scorer(f"python:{module_name}", {})
    with pytest.raises(ScorerError, match="no such file"):
        make_scorer(f"python:{tmp_path}/missing.py:fn", {})
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ScorerError, match=r"cannot import .*broken.py: SyntaxError"):
        make_scorer(f"python:{broken}:f", {})
