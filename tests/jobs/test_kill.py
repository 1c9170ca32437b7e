"""kill -9 a real `tokenmill run` mid-way, re-run it: exactly one result per input line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import assert_exactly_once, kill_9_after, read_jsonl

REVIEWS = [
    "The kettle boils fast.", "The lid broke after a week.", "Great value for the price.",
    "Arrived late and scratched.", "My kids love it.", "Stopped working after a month.",
    "Comfortable and light.", "Too loud to use at night.", "Exactly as described.",
    "The battery barely lasts a day.", "Easy to set up.", "Smells of plastic.",
]


@pytest.mark.slow
def test_kill_9_then_rerun_gives_exactly_one_result_per_line(tmp_path: Path, gguf_path: Path) -> None:
    path = tmp_path / "reviews.txt"
    path.write_text("\n".join(REVIEWS) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--system", "Label the review.",
           "--max-tokens", "6", "--temperature", "0", "--max-num-seqs", "2", "--no-progress"]
    results = out / "results.jsonl"
    done_before = kill_9_after(cmd, results, 1)  # the model loads in ~12 s
    assert 1 <= done_before < len(REVIEWS), "the kill did not land mid-way"
    with results.open("ab") as f:  # as if the kill had also torn a write in half
        f.write(b'{"id":"batch_req_x","custom_id":"line-12","response":{"status_co')

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "repaired a torn last line" in rerun.stderr and f"resuming: {done_before} done" in rerun.stderr
    assert_exactly_once(out, len(REVIEWS))
    assert sorted(r["custom_id"] for r in read_jsonl(results)) == sorted(f"line-{i}" for i in range(1, 13))
