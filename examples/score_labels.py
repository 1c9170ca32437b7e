"""Label accuracy of a `tokenmill run` job on examples/reviews.jsonl.

    python examples/score_labels.py out/demo/results.jsonl examples/reviews.labels.jsonl

Reads the answer of every result row (an OpenAI batch output row) and takes its label: the "label"
field of a JSON answer, otherwise the first word ("label | summary" free text, or a `choice`
answer, which is the label alone). Prints `N/M correct (xx.x%)` over all labelled requests, how
many answers did not parse (not JSON where JSON began, or no known label), and how many requests
have no answer (an error row, or none at all); both count as wrong.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from pathlib import Path


def answer_text(row: dict) -> str | None:
    """The assistant's text of a result row; None for an error row."""
    body = (row.get("response") or {}).get("body") or {}
    choices = body.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    return choice["message"]["content"] if "message" in choice else choice.get("text")


def extract_label(text: str) -> str | None:
    """The label an answer gives, lowercased; None when it gives none."""
    text = text.strip()
    if text.startswith("{"):
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:  # e.g. cut by max_tokens
            return None
        label = answer.get("label") if isinstance(answer, dict) else None
        return label.lower() if isinstance(label, str) else None
    first_word = re.match(r"[A-Za-z]+", text)
    return first_word.group(0).lower() if first_word else None


def main(results_path: str, labels_path: str) -> None:
    truth = {row["custom_id"]: row["label"] for row in map(json.loads, Path(labels_path).read_text().splitlines())}
    known = set(truth.values())
    predicted: dict[str, str | None] = {}  # custom_id -> label, None where the answer gives none
    for line in Path(results_path).read_text().splitlines():
        row = json.loads(line)
        text = answer_text(row)
        if text is not None:
            label = extract_label(text)
            predicted[row["custom_id"]] = label if label in known else None  # "great" is no label
    correct = sum(predicted.get(cid) == label for cid, label in truth.items())
    unparsed = sum(label is None for label in predicted.values())
    unanswered = len(truth.keys() - predicted.keys())
    print(f"{correct}/{len(truth)} correct ({correct / len(truth):.1%}); {unparsed} answers did not parse"
          + (f"; {unanswered} with no answer" if unanswered else ""))
    answers = Counter(label or "(none)" for label in predicted.values())
    print("answers: " + ", ".join(f"{label} {n}" for label, n in answers.most_common()))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
