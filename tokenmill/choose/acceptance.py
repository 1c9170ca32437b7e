"""Acceptance checks: whether a cascade tier's answer is good enough to stop at that tier, judged
without a label (the cascade runs on rows nobody has labelled).

`--accept` takes one of these; given several, an answer must pass them all:

- `parses`: the answer is whole (not cut by max_tokens) and valid under the tier's structured
  output (a JSON schema, JSON mode, a choice or a regex);
- `regex:PATTERN`: the answer matches PATTERN somewhere (Python `re.search`);
- `json-fields:A,B`: the answer is a JSON object with fields A and B, neither null nor empty;
- `python:MODULE:FUNCTION` / `python:FILE.py:FUNCTION`: `fn(answer) -> bool | 0..1`, accepted at 1
  (True), or at the threshold given as `python:…:fn>=0.7`;
- `mean-logprob>=X` / `min-logprob>=X` (X <= 0): the mean or lowest log-probability of the
  answer's tokens, as the model returned them (`logprobs`);
- `margin>=X` (X in 0..1): the smallest gap between the likeliest and the second likeliest token
  over the answer's tokens. For a `choice` on the embedded engine (whose log-probabilities are
  taken after the choice's mask) that is the gap between the two likeliest labels where they part.

A confidence check written without its threshold (`min-logprob`) is for `tokenmill choose` to
calibrate on the labelled sample; a cascade job needs every threshold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.choose.candidates import Candidate
from tokenmill.choose.scorers import PYTHON_FORMS, PYTHON_PREFIX, PythonScorer, ScorerError, strip_fence
from tokenmill.jobs.results import answer_of, finish_reason_of
from tokenmill.openai_compat import structured_outputs

CONFIDENCE = {"mean-logprob": (-math.inf, 0.0), "min-logprob": (-math.inf, 0.0), "margin": (0.0, 1.0)}
FORMS = ("parses", "regex:PATTERN", "json-fields:A,B", PYTHON_FORMS, "mean-logprob>=X", "min-logprob>=X",
         "margin>=X")
TOP_FOR_MARGIN = 2  # alternatives per token a margin needs: the likeliest and the next


class AcceptanceError(ValueError):
    """An --accept that cannot be one, or an answer a check cannot be applied to (no logprobs)."""


@dataclass(frozen=True)
class TokenChoice:
    """One answer token as the response's `logprobs` gives it: its log-probability and the
    log-probabilities of the likeliest alternatives (itself among them, where it is one)."""

    logprob: float
    top: tuple[float, ...]


def token_logprobs(body: dict[str, Any]) -> list[TokenChoice] | None:
    """The answer's tokens from an OpenAI response's `choices[0].logprobs`, chat or completions
    shape; None where the response has none."""
    choices = body.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") if isinstance(choices[0], dict) else None
    if not isinstance(logprobs, dict):
        return None
    if isinstance(logprobs.get("content"), list):  # chat
        return [TokenChoice(t["logprob"], tuple(a["logprob"] for a in t.get("top_logprobs") or ()))
                for t in logprobs["content"]]
    if isinstance(logprobs.get("token_logprobs"), list):  # completions
        tops = logprobs.get("top_logprobs") or [None] * len(logprobs["token_logprobs"])
        return [TokenChoice(lp, tuple(sorted((top or {}).values(), reverse=True)))
                for lp, top in zip(logprobs["token_logprobs"], tops, strict=True)]
    return None


@dataclass(frozen=True)
class Check:
    """One acceptance check. `statistic` (for threshold checks) or `test` (for the rest) decides."""

    text: str  # as the user wrote it, less any threshold
    threshold: float | None = None  # None on a confidence check: choose calibrates it
    statistic: Callable[[dict[str, Any], str], float] | None = None  # (body, answer) → value
    test: Callable[[dict[str, Any], str], str | None] | None = None  # (body, answer) → why not, or None
    logprobs: int | None = None  # alternatives per token it needs returned; None: needs no logprobs

    def rejects(self, body: dict[str, Any]) -> str | None:
        """Why the answer in `body` does not pass (a short reason), or None when it does."""
        answer = answer_of(body) or ""
        if self.test is not None:
            return self.test(body, answer)
        assert self.statistic is not None and self.threshold is not None
        value = self.statistic(body, answer)
        return None if value >= self.threshold else f"{self.text} {value:.3g} < {self.threshold:g}"

    @property
    def calibrated(self) -> bool:
        """Its threshold is for choose to find."""
        return self.statistic is not None and self.threshold is None


@dataclass(frozen=True)
class Acceptance:
    """The checks an answer must all pass to stop at its tier."""

    checks: tuple[Check, ...] = field(default_factory=tuple)

    def rejects(self, body: dict[str, Any]) -> str | None:
        for check in self.checks:
            if (reason := check.rejects(body)) is not None:
                return reason
        return None

    @property
    def logprobs(self) -> int | None:
        """The `logprobs` (alternatives per token) the checks need the tier to ask for."""
        needs = [c.logprobs for c in self.checks if c.logprobs is not None]
        return max(needs) if needs else None

    def describe(self) -> str:
        return " and ".join(c.text + (f">={c.threshold:g}" if c.threshold is not None else "")
                            for c in self.checks)


def acceptance_for(tier: Candidate, texts: list[str], flag: str) -> Acceptance:
    """The checks as they apply to a cascade's `tier` (`parses`: against its own structured output);
    the error names the tier as the user gave it (`flag`: --tier, --candidate)."""
    try:
        return parse_acceptance(texts, structured_outputs(tier.job.options.structured_outputs or {}))
    except AcceptanceError as exc:
        raise AcceptanceError(f"{flag} {tier.name}: {exc}") from None


def parse_acceptance(texts: list[str], structured: Any = None) -> Acceptance:
    """The --accept checks; `structured`: the tier's StructuredOutputsParams, for `parses`."""
    if not texts:
        raise AcceptanceError(f"a cascade needs at least one --accept check: {', '.join(FORMS)}")
    return Acceptance(tuple(parse_check(t, structured) for t in texts))


def parse_check(text: str, structured: Any = None) -> Check:
    """One --accept; AcceptanceError names it and what would be one."""
    name, threshold = _split_threshold(text)
    if name in CONFIDENCE:
        low, high = CONFIDENCE[name]
        # not finite: -inf would accept every answer, and nan compares false with every value
        if threshold is not None and not (math.isfinite(threshold) and low <= threshold <= high):
            raise AcceptanceError(f"--accept {text}: the threshold of {name} must be in "
                                  f"{'(-inf' if low == -math.inf else f'[{low:g}'}, {high:g}], got {threshold:g}")
        needs = TOP_FOR_MARGIN if name == "margin" else 0
        return Check(name, threshold, statistic=_CONFIDENCE_STATISTICS[name], logprobs=needs)
    if name.startswith(PYTHON_PREFIX):
        return _python_check(name, 1.0 if threshold is None else threshold)
    if name != "parses" and not name.startswith(("regex:", "json-fields:")):
        raise AcceptanceError(f"--accept {text}: unknown check; known: {', '.join(FORMS)}")
    if threshold is not None:
        raise AcceptanceError(f"--accept {text}: {name} takes no threshold")
    if name == "parses":
        return Check(name, test=_parses_test(structured))
    if name.startswith("regex:"):
        try:
            pattern = re.compile(name[len("regex:"):])
        except re.error as exc:
            raise AcceptanceError(f"--accept {text}: the pattern does not compile: {exc}") from None
        return Check(name, test=lambda _, answer: None if pattern.search(answer) else "no regex match")
    names = [f for f in name[len("json-fields:"):].split(",") if f]
    if not names:
        raise AcceptanceError(f"--accept {text}: name the fields, e.g. json-fields:name,price")
    return Check(name, test=lambda _, answer: _missing_fields(answer, names))


def _split_threshold(text: str) -> tuple[str, float | None]:
    """(check, threshold): `min-logprob>=-1` → ("min-logprob", -1.0); a pattern keeps its ">=" (`regex:a>=b`)."""
    name, sep, value = text.strip().rpartition(">=")
    if not sep or text.strip().startswith(("regex:", "json-fields:")):
        return text.strip(), None
    try:
        threshold = float(value)
    except ValueError:
        raise AcceptanceError(f"--accept {text}: the threshold {value!r} is not a number") from None
    return name.strip(), threshold


# ---- confidence ----------------------------------------------------------------------------------
def _tokens(body: dict[str, Any]) -> list[TokenChoice]:
    tokens = token_logprobs(body)
    if tokens is None:
        raise AcceptanceError("the response carries no logprobs: this engine or endpoint did not return the "
                              "log-probabilities a confidence check needs")
    return tokens


def _mean_logprob(body: dict[str, Any], _: str) -> float:
    tokens = _tokens(body)
    return sum(t.logprob for t in tokens) / len(tokens) if tokens else -math.inf


def _min_logprob(body: dict[str, Any], _: str) -> float:
    return min((t.logprob for t in _tokens(body)), default=-math.inf)


def _margin(body: dict[str, Any], _: str) -> float:
    """The smallest p(first) - p(second) over the answer's tokens; 1 for a token with no rival."""
    margins = []
    for token in _tokens(body):
        if not token.top:
            raise AcceptanceError("the response's logprobs carry no top_logprobs: margin needs the two likeliest "
                                  "tokens at each step")
        best = sorted(token.top, reverse=True)
        margins.append(math.exp(best[0]) - (math.exp(best[1]) if len(best) > 1 else 0.0))
    return min(margins, default=0.0)


_CONFIDENCE_STATISTICS = {"mean-logprob": _mean_logprob, "min-logprob": _min_logprob, "margin": _margin}


# ---- the rest ------------------------------------------------------------------------------------
def _parses_test(structured: Any) -> Callable[[dict[str, Any], str], str | None]:
    if structured is None:
        raise AcceptanceError("--accept parses needs the tier to ask for a structured output "
                              "(--json-schema, --choice or --regex): it checks the answer against it")
    kind = structured.kind
    if kind == "grammar":
        raise AcceptanceError("--accept parses cannot check a grammar outside the engine: use --json-schema, "
                              "--choice or --regex, or a regex:/python: check")
    valid = _validator(structured)

    def test(body: dict[str, Any], answer: str) -> str | None:
        if finish_reason_of(body) == "length":
            return "cut by max_tokens"
        return valid(answer)

    return test


def _validator(structured: Any) -> Callable[[str], str | None]:
    if structured.choice is not None:
        choices = set(structured.choice)
        return lambda answer: None if answer in choices else "not one of the choices"
    if structured.regex is not None:
        try:
            pattern = re.compile(structured.regex)
        except re.error as exc:
            raise AcceptanceError(f"--accept parses: the tier's --regex is not a Python regex ({exc})") from None
        return lambda answer: None if pattern.fullmatch(answer) else "no regex match"
    schema = structured.json if structured.json is not None else {"type": "object"}
    if isinstance(schema, str):
        schema = json.loads(schema)
    import jsonschema  # type: ignore[import-untyped]  # only a JSON check needs it

    validator = jsonschema.validators.validator_for(schema)(schema)

    def valid_json(answer: str) -> str | None:
        try:
            value = json.loads(strip_fence(answer))
        except json.JSONDecodeError:
            return "not JSON"
        return None if validator.is_valid(value) else "schema"

    return valid_json


def _missing_fields(answer: str, names: list[str]) -> str | None:
    try:
        value = json.loads(strip_fence(answer))
    except json.JSONDecodeError:
        return "not JSON"
    if not isinstance(value, dict):
        return "not a JSON object"
    missing = [n for n in names if value.get(n) in (None, "", [], {})]
    return f"no {', '.join(missing)}" if missing else None


def _python_check(spec: str, threshold: float) -> Check:
    if not 0 <= threshold <= 1:
        raise AcceptanceError(f"--accept {spec}>={threshold:g}: the threshold must be in [0, 1]")
    try:
        fn = PythonScorer.load(spec).fn
    except ScorerError as exc:
        raise AcceptanceError(f"--accept {exc}") from None
    scorer = PythonScorer(spec, lambda answer, _expected: fn(answer))  # its checks of what fn returns

    def test(_: dict[str, Any], answer: str) -> str | None:
        value = scorer.score(answer, None, "?").value
        return None if value >= threshold else f"{spec} {value:.3g} < {threshold:g}"

    return Check(spec, test=test)
