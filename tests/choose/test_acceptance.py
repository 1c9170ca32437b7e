"""--accept's confidence thresholds: a threshold outside the range the message states is refused."""

from __future__ import annotations

import re

import pytest

from tokenmill.choose.acceptance import AcceptanceError, parse_check


@pytest.mark.parametrize(
    ("text", "refusal"),
    [
        # -inf would accept every answer: the range is open there
        ("mean-logprob>=-inf", "the threshold of mean-logprob must be in (-inf, 0], got -inf"),
        ("min-logprob>=-inf", "the threshold of min-logprob must be in (-inf, 0], got -inf"),
        ("mean-logprob>=nan", "the threshold of mean-logprob must be in (-inf, 0], got nan"),
        ("margin>=nan", "the threshold of margin must be in [0, 1], got nan"),
    ],
    ids=["mean-logprob-inf", "min-logprob-inf", "mean-logprob-nan", "margin-nan"],
)
def test_a_threshold_that_is_not_finite_is_refused_with_the_range(text: str, refusal: str) -> None:
    with pytest.raises(AcceptanceError, match=f"^{re.escape(f'--accept {text}: {refusal}')}$"):
        parse_check(text)
