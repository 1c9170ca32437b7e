"""`tokenmill choose` on the embedded engine: the real model, free text against a `choice`
constraint, on a small sample of the reviews demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jobs.conftest import read_jsonl
from tokenmill.cli import main
from tokenmill.jobs.journal.rows import answer_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LABELS = ("positive", "negative", "mixed")


@pytest.mark.slow
def test_free_text_against_a_choice_on_the_real_model(gguf_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main([
        "choose", str(EXAMPLES / "reviews.jsonl"), "--expected", str(EXAMPLES / "reviews.labels.jsonl"),
        "-o", str(out), "--no-progress", "--scorer", "label", "--min-quality", "0.3", "--sample", "6",
        "--flags", f"--model {gguf_path} --temperature 0 --max-num-seqs 6", "--price-per-hour", "0.1",
        "--hardware", "h100-sxm",
        "--candidate", "free=--max-tokens 8", "--candidate", "choice=--choice positive,negative,mixed",
    ])
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    truth = {r["custom_id"]: r["label"] for r in read_jsonl(EXAMPLES / "reviews.labels.jsonl")}
    for c in data["candidates"]:
        assert c["status"] == "done" and c["backend"] == "embedded" and c["answered"] == 6
        assert c["output_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["usd_per_m_output"] > 0
        assert c["projected"]["rows"] == 240 and c["projected"]["usd"] > 0
        assert c["ceiling"]["hardware"] == "H100-SXM" and c["ceiling"]["usd_per_m_output"] > 0
        # The quality is the share of answers whose first label word is the true label, checked here
        # independently of the scorer.
        rows = read_jsonl(out / "candidates" / c["name"] / "results.jsonl")
        right = sum(_first_label(answer_of(r["response"]["body"]) or "") == truth[r["custom_id"]] for r in rows)
        assert c["quality"]["mean"] == pytest.approx(right / 6)
    choice = next(c for c in data["candidates"] if c["name"] == "choice")
    answers = [answer_of(r["response"]["body"]) for r in read_jsonl(out / "candidates" / "choice" / "results.jsonl")]
    assert set(answers) <= set(LABELS) and "no label" not in choice["notes"]


def _first_label(text: str) -> str | None:
    words = [w.strip(".,|*:;!\"'").lower() for w in text.split()]
    return next((w for w in words if w in LABELS), None)
