"""The LLM judge of `tokenmill choose`: a rubric prompt asks a model on an OpenAI-compatible
endpoint to grade an answer against the reference, and its reply ends with `SCORE: n`.

Only the pure parts live here: the rubric, the request body for one answer and the reading of the
reply. The judge's requests run as a batch job like any other (runner.py).
"""

from __future__ import annotations

import re
import string
from typing import Any

from tokenmill.choose.scorers import Score, as_text

PLACEHOLDERS = ("prompt", "answer", "expected")
JUDGE_MAX_TOKENS = 256  # room for a few sentences of reasons before the score line

DEFAULT_RUBRIC = """\
You are grading an answer against a reference answer.

The task:
{prompt}

The reference answer:
{expected}

The answer to grade:
{answer}

Judge whether the answer is correct: does it say what the reference says? Ignore wording, length \
and formatting; penalise wrong, missing or contradicting facts. Give a short reason, then end your \
reply with one line

SCORE: n

where n is an integer from 0 (wrong) to 10 (as correct as the reference)."""

# The last "SCORE: n" or "SCORE: n/d"; Markdown bold around it ("**Score:** 7") is common.
_SCORE = re.compile(
    r"\bscore\**\s*:\s*\**\s*(\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?",
    re.IGNORECASE,
)


def check_rubric(text: str) -> None:
    """ValueError unless the rubric has `{answer}` and no placeholder besides the three known ones."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:  # a lone "{" or "}"
        raise ValueError(f"rubric: {exc}; write a literal brace as {{{{ or }}}}") from None
    unknown = [name for name in fields if name not in PLACEHOLDERS]
    if unknown:
        known = ", ".join(f"{{{p}}}" for p in PLACEHOLDERS)
        raise ValueError(
            f"rubric: unknown placeholder {{{unknown[0]}}} (known: {known}; write a literal brace as {{{{ or }}}})"
        )
    if "answer" not in fields:
        raise ValueError("rubric: no {answer} placeholder, where the answer to grade goes")


def judge_body(rubric: str, prompt: str, answer: str, expected: Any, model: str | None) -> dict[str, Any]:
    """The chat-completions body asking the judge to grade one answer."""
    check_rubric(rubric)
    content = rubric.format(prompt=prompt, answer=answer, expected=as_text(expected))
    # Temperature 0: the same answer should get the same grade from every candidate's run.
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": JUDGE_MAX_TOKENS,
    }
    if model is not None:
        body["model"] = model
    return body


def parse_judge_reply(text: str, scale: int = 10) -> Score:
    """The last `SCORE: n` line ÷ the scale (or the line's own `/d`), clipped to 0..1."""
    if scale <= 0:
        raise ValueError(f"the judge's scale must be > 0, got {scale}")
    # The last one: a judge may quote the rubric's "SCORE: n" or revise itself before the end.
    matches = list(_SCORE.finditer(text))
    if not matches:
        return Score(0.0, "judge unparsed")
    number, denominator = matches[-1].groups()
    out_of = float(denominator) if denominator is not None else float(scale)
    if out_of == 0:
        return Score(0.0, "judge unparsed")
    return Score(min(max(float(number) / out_of, 0.0), 1.0))
