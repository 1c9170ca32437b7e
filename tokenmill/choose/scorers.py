"""How `tokenmill choose` scores one answer against its expected answer: a `Score` from 0 to 1, with a
short note saying why it fell below 1 (the report counts the notes, so they are a few fixed words).

Scorers, by `--scorer`:

- `exact`: the whole answer, trimmed, is the expected one;
- `label`: the first known label (any row's expected value) in the answer is the row's own;
- `json`: the answer parses (and fits `--schema`); an expected object gives credit per matching field;
- `regex`: the expected value is a pattern the answer matches;
- `contains`: the expected text appears in the answer;
- `python:MODULE:FUNCTION` / `python:path/file.py:FUNCTION`: the user's own `fn(answer, expected)`.

`judge` grades through an LLM endpoint (judge.py); the caller runs it, so it is no row scorer here.
`make_scorer` checks what it can before any candidate runs: a scorer that would fail on row 900
should fail before the first GPU-hour is spent.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np

SCORERS = ("exact", "label", "json", "regex", "contains", "judge")
DEFAULT_SCORER = "exact"
PYTHON_PREFIX = "python:"
PYTHON_FORMS = "python:MODULE:FUNCTION or python:path/file.py:FUNCTION"

_FENCE = re.compile(r"^```[\w+-]*[ \t]*\n?(.*?)\n?[ \t]*```$", re.DOTALL)


@dataclass(frozen=True)
class Score:
    value: float  # 0..1
    # Why below 1, a short countable category: "no label", "wrong label", "not JSON", "schema",
    # "fields differ", "no match", "not found", "differs", "scored < 1", "judge unparsed".
    note: str | None = None


class ScorerError(ValueError):
    """A scorer that cannot be built, or cannot score a row; the message names the scorer (and the row)."""


class Scorer(Protocol):
    name: str

    def score(self, answer: str, expected: Any, custom_id: str) -> Score: ...


def make_scorer(spec: str, expected: Mapping[str, Any], schema: dict[str, Any] | None = None) -> Scorer:
    """The scorer `spec` names, checked against every expected answer; raises ScorerError."""
    if spec == "judge":
        raise ScorerError("judge is not a row scorer: it grades through an endpoint, which the caller runs")
    if schema is not None and spec != "json":
        raise ScorerError(f"--schema only applies to the json scorer, not {spec}")
    if spec.startswith(PYTHON_PREFIX):
        return PythonScorer.load(spec)
    if spec == "exact":
        return ExactScorer()
    if spec == "label":
        return LabelScorer.build(expected)
    if spec == "json":
        return JsonScorer.build(schema)
    if spec == "regex":
        return RegexScorer.build(expected)
    if spec == "contains":
        return ContainsScorer.build(expected)
    raise ScorerError(f"unknown scorer {spec!r}; known: {', '.join(SCORERS)}, {PYTHON_FORMS}")


# ---------------------------------------------------------------------------------------------
# Text helpers


def collapse(text: str) -> str:
    """Casefolded, with every run of whitespace one space: how loose comparisons see text."""
    return " ".join(text.casefold().split())


def normalise_label(text: str) -> str:
    """`collapse`, then punctuation stripped from each word's edges ("**Mixed**" → "mixed"), words
    that were only punctuation dropped ("positive | great" → "positive great")."""
    words = (_strip_edges(w) for w in text.casefold().split())
    return " ".join(w for w in words if w)


def _strip_edges(word: str) -> str:
    start, end = 0, len(word)
    while start < end and not word[start].isalnum():
        start += 1
    while end > start and not word[end - 1].isalnum():
        end -= 1
    return word[start:end]


def as_text(value: Any) -> str:
    """A string as itself, any other JSON value as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def same_value(got: Any, want: Any, loose: bool = True) -> bool:
    """JSON values equal: strings `collapse`d first when `loose`, booleans only to booleans (to
    Python `True == 1`, but a model answering 1 for true has not given the same answer)."""
    if isinstance(want, str) and isinstance(got, str):
        return collapse(got) == collapse(want) if loose else got == want
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k], loose) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(same_value(g, w, loose) for g, w in zip(got, want, strict=True))
    if isinstance(want, (dict, list, str)) or isinstance(got, (dict, list, str)):
        return False
    return bool(got == want)


def strip_fence(text: str) -> str:
    """The answer without surrounding whitespace or a Markdown code fence (```json … ```)."""
    text = text.strip()
    match = _FENCE.match(text)
    return match.group(1).strip() if match else text


def _non_string_id(expected: Mapping[str, Any]) -> str | None:
    return next((i for i, v in expected.items() if not isinstance(v, str)), None)


# ---------------------------------------------------------------------------------------------
# Scorers


@dataclass
class ExactScorer:
    name: str = "exact"

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        if isinstance(expected, str):
            same = answer.strip() == expected.strip()
        else:
            # A number or an object has many spellings ("1.0", "{ }"): compare the values.
            try:
                same = same_value(json.loads(answer), expected, loose=False)
            except json.JSONDecodeError:
                same = False
        return Score(1.0) if same else Score(0.0, "differs")


@dataclass
class LabelScorer:
    labels: tuple[str, ...]  # normalised, longest first
    name: str = "label"
    _pattern: re.Pattern[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Longest first: at one position the alternation takes "very positive" over "positive";
        # re.search already prefers the earliest position. The lookarounds make labels whole words.
        alternatives = "|".join(re.escape(label) for label in self.labels)
        self._pattern = re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)")

    @classmethod
    def build(cls, expected: Mapping[str, Any]) -> LabelScorer:
        bad = _non_string_id(expected)
        if bad is not None:
            got = json.dumps(expected[bad])[:60]
            raise ScorerError(f'scorer label: the expected answer of row "{bad}" is not a string: {got}')
        labels = {normalise_label(v) for v in expected.values()}
        if "" in labels:
            empty = next(i for i, v in expected.items() if not normalise_label(v))
            raise ScorerError(f'scorer label: the expected label of row "{empty}" is empty')
        if not labels:
            raise ScorerError("scorer label: no expected labels")
        return cls(tuple(sorted(labels, key=lambda s: (-len(s), s))))

    def find(self, answer: str) -> str | None:
        """The known label that comes first in the answer, if any."""
        match = self._pattern.search(normalise_label(answer))
        return match.group(0) if match else None

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        if not isinstance(expected, str):
            raise ScorerError(f'scorer label: the expected answer of row "{custom_id}" is not a string')
        found = self.find(answer)
        if found is None:
            return Score(0.0, "no label")
        return Score(1.0) if found == normalise_label(expected) else Score(0.0, "wrong label")


@dataclass
class JsonScorer:
    validator: Any = None  # a jsonschema validator for --schema, or None
    name: str = "json"

    @classmethod
    def build(cls, schema: dict[str, Any] | None) -> JsonScorer:
        if schema is None:
            return cls()
        import jsonschema  # type: ignore[import-untyped]  # here: only --schema needs it

        validator_class = jsonschema.validators.validator_for(schema)
        try:
            validator_class.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ScorerError(f"scorer json: --schema is not a valid JSON Schema: {exc.message}") from None
        return cls(validator_class(schema))

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        try:
            got = json.loads(strip_fence(answer))
        except json.JSONDecodeError:
            return Score(0.0, "not JSON")
        if self.validator is not None and not self.validator.is_valid(got):
            return Score(0.0, "schema")
        if expected is None:  # null: the answer only has to parse (and fit the schema)
            return Score(1.0)
        if isinstance(expected, dict):
            return _field_credit(got, expected)
        return Score(1.0) if same_value(got, expected) else Score(0.0, "differs")


def _field_credit(got: Any, expected: dict[str, Any]) -> Score:
    """The share of the expected fields the answer has with the same value."""
    if not isinstance(got, dict):
        return Score(0.0, "fields differ")
    if not expected:
        return Score(1.0)
    right = sum(1 for k, v in expected.items() if k in got and same_value(got[k], v))
    value = right / len(expected)
    return Score(value) if value == 1 else Score(value, "fields differ")


@dataclass
class RegexScorer:
    patterns: dict[str, re.Pattern[str]] = field(default_factory=dict)  # cache: source → compiled
    name: str = "regex"

    @classmethod
    def build(cls, expected: Mapping[str, Any]) -> RegexScorer:
        scorer = cls()
        for custom_id, pattern in expected.items():  # compiling all now finds a bad one before any run
            scorer.compiled(pattern, custom_id)
        return scorer

    def compiled(self, pattern: Any, custom_id: str) -> re.Pattern[str]:
        if not isinstance(pattern, str):
            got = json.dumps(pattern)[:60]
            raise ScorerError(f'scorer regex: the expected answer of row "{custom_id}" is not a string: {got}')
        if pattern not in self.patterns:
            try:
                self.patterns[pattern] = re.compile(pattern)
            except re.error as exc:
                raise ScorerError(
                    f'scorer regex: the pattern of row "{custom_id}" does not compile: re.error: {exc}'
                ) from None
        return self.patterns[pattern]

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        found = self.compiled(expected, custom_id).search(answer)
        return Score(1.0) if found else Score(0.0, "no match")


@dataclass
class ContainsScorer:
    name: str = "contains"

    @classmethod
    def build(cls, expected: Mapping[str, Any]) -> ContainsScorer:
        # An empty expected text is in every answer: it would score 1 whatever the model says.
        empty = next((i for i, v in expected.items() if not collapse(as_text(v))), None)
        if empty is not None:
            raise ScorerError(f'scorer contains: the expected text of row "{empty}" is empty')
        return cls()

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        return Score(1.0) if collapse(as_text(expected)) in collapse(answer) else Score(0.0, "not found")


@dataclass
class PythonScorer:
    """`fn(answer, expected)` from the user's code: a bool, or a number from 0 to 1."""

    name: str
    fn: Callable[[str, Any], Any]

    @classmethod
    def load(cls, spec: str) -> PythonScorer:
        target, _, function = spec[len(PYTHON_PREFIX) :].rpartition(":")
        if not target or not function:
            raise ScorerError(f"scorer {spec}: expected {PYTHON_FORMS}")
        module = _load_module(spec, target)
        fn = getattr(module, function, None)
        if fn is None:
            raise ScorerError(f"scorer {spec}: {target} has no function {function!r}")
        if not callable(fn):
            raise ScorerError(f"scorer {spec}: {target}.{function} is not callable ({type(fn).__name__})")
        return cls(spec, fn)

    def score(self, answer: str, expected: Any, custom_id: str) -> Score:
        try:
            result = self.fn(answer, expected)
        except Exception as exc:
            raise ScorerError(f'scorer {self.name} raised on row "{custom_id}": {_describe(exc)}') from exc
        value = self._value(result, custom_id)
        return Score(value) if value == 1 else Score(value, "scored < 1")

    def _value(self, result: Any, custom_id: str) -> float:
        if isinstance(result, (bool, np.bool_)):  # before numbers: a bool is an int to Python
            return 1.0 if result else 0.0
        if isinstance(result, (int, float, np.integer, np.floating)):
            value = float(result)
            if not math.isnan(value) and 0 <= value <= 1:
                return value
        raise ScorerError(
            f'scorer {self.name} returned {result!r} on row "{custom_id}": expected a bool or a number from 0 to 1'
        )


def _load_module(spec: str, target: str) -> ModuleType:
    if target.endswith(".py") or "/" in target or os.sep in target:
        return _load_file(spec, Path(target))
    # The `tokenmill` console script does not put the current directory on sys.path (`python -m`
    # does), yet `python:myscorer:fn` means the myscorer.py beside the user.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise ScorerError(f"scorer {spec}: cannot import {target}: {_describe(exc)}") from exc


def _load_file(spec: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise ScorerError(f"scorer {spec}: cannot import {path}: no such file")
    name = f"tokenmill_scorer_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ScorerError(f"scorer {spec}: cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before it runs, as importlib's recipe does: dataclasses and pickling in the user's
    # file look their module up in sys.modules.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise ScorerError(f"scorer {spec}: cannot import {path}: {_describe(exc)}") from exc
    return module


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
