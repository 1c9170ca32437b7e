"""The LLM judge's pure parts: the rubric's placeholders, the request body for one answer, and the
score read from the judge's reply."""

from __future__ import annotations

import pytest

from tokenmill.choose.judge import DEFAULT_RUBRIC, check_rubric, judge_body, parse_judge_reply
from tokenmill.choose.scorers import Score


def test_the_default_rubric_is_valid_and_asks_for_a_score_line() -> None:
    check_rubric(DEFAULT_RUBRIC)
    for placeholder in ("{prompt}", "{answer}", "{expected}"):
        assert placeholder in DEFAULT_RUBRIC
    assert "SCORE: n" in DEFAULT_RUBRIC
    assert parse_judge_reply(DEFAULT_RUBRIC).note == "judge unparsed"  # quoting the rubric scores nothing


def test_check_rubric() -> None:
    check_rubric("Grade {answer}. Literal braces: {{like this}}.")  # only {answer} is required
    with pytest.raises(ValueError, match=r"no \{answer\} placeholder"):
        check_rubric("Grade {prompt} against {expected}")
    with pytest.raises(ValueError, match=r"unknown placeholder \{reference\}"):
        check_rubric("{answer} vs {reference}")
    with pytest.raises(ValueError, match=r"unknown placeholder \{\}"):
        check_rubric("{answer} vs {}")
    with pytest.raises(ValueError, match=r"unknown placeholder \{answer\.upper\}"):
        check_rubric("{answer.upper}")
    with pytest.raises(ValueError, match=r"unknown placeholder \{\"score\"\}.*write a literal brace as \{\{"):
        check_rubric('{answer} as JSON: {"score": 1}')
    with pytest.raises(ValueError, match="Single '}' encountered.*literal brace"):
        check_rubric("{answer} }")


def test_judge_body_fills_the_rubric() -> None:
    rubric = "Task: {prompt}\nRef: {expected}\nAnswer: {answer}\nSCORE: n"
    body = judge_body(rubric, "Name it", "It is {x}", {"name": "Ada"}, "judge-model")
    assert body == {
        "messages": [{"role": "user", "content": 'Task: Name it\nRef: {"name": "Ada"}\nAnswer: It is {x}\nSCORE: n'}],
        "temperature": 0,
        "max_tokens": 256,
        "model": "judge-model",
    }
    plain = judge_body("{answer} / {expected}", "p", "a", "ref", None)
    assert plain["messages"][0]["content"] == "a / ref"  # a string expected stays unquoted
    assert "model" not in plain
    with pytest.raises(ValueError, match="unknown placeholder"):
        judge_body("{answer} {bogus}", "p", "a", "r", None)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Good answer.\nSCORE: 7", Score(0.7)),
        ("First SCORE: 2, then on reflection\nSCORE: 9", Score(0.9)),  # the last one wins
        ("SCORE: 7/10", Score(0.7)),
        ("Score: 3 / 4", Score(0.75)),  # its own denominator overrides the scale
        ("score: 8.5", Score(0.85)),
        ("**Score:** 6", Score(0.6)),
        ("SCORE: 12", Score(1.0)),  # clipped
        ("SCORE: 0", Score(0.0)),
        ("SCORE: 3/0", Score(0.0, "judge unparsed")),
        ("It is correct, 10 out of 10.", Score(0.0, "judge unparsed")),
        ("", Score(0.0, "judge unparsed")),
        ("underscore: 5", Score(0.0, "judge unparsed")),
    ],
)
def test_parse_judge_reply(reply: str, expected: Score) -> None:
    got = parse_judge_reply(reply)
    assert got.value == pytest.approx(expected.value)
    assert got.note == expected.note


def test_parse_judge_reply_scale() -> None:
    assert parse_judge_reply("SCORE: 4", scale=5).value == pytest.approx(0.8)
    assert parse_judge_reply("SCORE: 4/8", scale=5).value == pytest.approx(0.5)
    with pytest.raises(ValueError, match="scale"):
        parse_judge_reply("SCORE: 4", scale=0)
