"""The expected-answers file of `tokenmill choose`, and how its ids line up with the job's.

JSONL, one object a line: the row's id under `custom_id` (or `id`) and its expected answer under
`expected`, or, when there is no `expected`, under the one field left besides the id, so a labelled
file such as `{"custom_id": "review-001", "label": "positive"}` works as it is. The answer may be any
JSON value. Every problem stops the read with the file and line named: a wrong expected answer would
quietly bias every candidate's score, so nothing is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.jobs.input import json_object_line

ID_KEYS = ("custom_id", "id")  # the first one present is the row's id
ANSWER_KEY = "expected"


class ExpectedError(ValueError):
    """The expected-answers file cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class IdCheck:
    """How the job's ids and the expected ids differ."""

    missing: list[str]  # job ids with no expected answer, in job order
    unknown: list[str]  # expected ids that are not in the job, in file order

    def warnings(self, max_listed: int = 5) -> list[str]:
        """One human line per kind of mismatch; empty when the ids match."""
        lines = []
        if self.missing:
            lines.append(
                f"{len(self.missing)} job row(s) have no expected answer{_listed(self.missing, max_listed)}; "
                "they are left out of the sample"
            )
        if self.unknown:
            lines.append(f"{len(self.unknown)} expected id(s) are not in the job{_listed(self.unknown, max_listed)}")
        return lines


def read_expected(path: Path) -> dict[str, Any]:
    """Row id → expected answer, in file order; raises ExpectedError for any bad line."""
    if not path.is_file():
        raise FileNotFoundError(f"expected-answers file {str(path)!r} not found")
    answers: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                if not raw.strip():
                    continue
                obj = json_object_line(raw, number)  # LineError (a ValueError) saying why not
                custom_id, answer = _row_id(obj), _answer(obj)
                if custom_id in first_line:
                    raise ValueError(f"duplicate id {json.dumps(custom_id)} (first on line {first_line[custom_id]})")
            except ValueError as exc:
                raise ExpectedError(f"{path}: line {number}: {exc}") from None
            first_line[custom_id] = number
            answers[custom_id] = answer
    if not answers:
        raise ExpectedError(f"{path}: no expected answers (the file is empty)")
    return answers


def compare_ids(sample_ids: Iterable[str], expected: Mapping[str, Any]) -> IdCheck:
    """`sample_ids` are the job's ids in job order."""
    job_ids = list(sample_ids)
    in_job = set(job_ids)
    return IdCheck(
        missing=[i for i in job_ids if i not in expected],
        unknown=[i for i in expected if i not in in_job],
    )


def _row_id(obj: dict[str, Any]) -> str:
    key = next((k for k in ID_KEYS if k in obj), None)
    if key is None:
        raise ValueError('no "custom_id" (or "id")')
    value = obj[key]
    # bool is an int to Python, but `true` is no id a job would have.
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f'"{key}" must be a non-empty string or an integer, got {json.dumps(value)}')
    return str(value)


def _answer(obj: dict[str, Any]) -> Any:
    if ANSWER_KEY in obj:
        return obj[ANSWER_KEY]
    # Both id keys are set aside: a line with "custom_id" and "id" (copied from a batch file, say)
    # still has its one answer field.
    others = [k for k in obj if k not in ID_KEYS]
    if not others:
        raise ValueError("no expected answer (only an id)")
    if len(others) > 1:
        names = ", ".join(json.dumps(k) for k in others)
        raise ValueError(
            f'no "{ANSWER_KEY}" field and {len(others)} other fields ({names}): say which with "{ANSWER_KEY}"'
        )
    return obj[others[0]]


def _listed(ids: list[str], limit: int) -> str:
    """ " (first: a, b, …)", or nothing when `limit` asks for no names."""
    if limit <= 0:
        return ""
    shown = ", ".join(ids[:limit])
    return f" (first: {shown}, …)" if len(ids) > limit else f" (first: {shown})"
