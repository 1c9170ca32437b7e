"""The README's cascade command on the embedded model, as it is written: killed with kill -9 while
its second tier runs, then run again, it answers every row of the reviews job exactly once."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_command(out: Path) -> list[str]:
    match = re.search(r"<!-- cascade -->\n```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert match, "README.md lost its <!-- cascade --> example"
    words = shlex.split(match.group(1).replace("\\\n", " "))
    assert words[:2] == ["tokenmill", "cascade"] and "--overwrite" not in words  # a re-run must resume
    words[words.index("-o") + 1] = str(out)
    return [sys.executable, "-m", "tokenmill", *words[1:], "--no-progress"]


@pytest.mark.slow
def test_the_readme_cascade_resumes_after_kill_9_with_every_row_once(tmp_path: Path) -> None:
    out = tmp_path / "cascade"
    cmd = readme_command(out)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = out / "tiers" / "free" / "job.json"  # the second tier's job has begun
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not second.exists() and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert second.exists(), "the second tier never started"
    first_tier = (out / "tiers" / "choice" / "results.jsonl").read_bytes()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "tiers" / "choice" / "results.jsonl").read_bytes() == first_tier  # not run again
    ids = _ids(ROOT / "examples" / "reviews.jsonl")
    assert sorted(_ids(out / "results.jsonl")) == sorted(ids)  # every row, once
    free = _ids(out / "tiers" / "free" / "results.jsonl")
    assert len(free) == len(set(free))  # no row answered twice by the second tier
    summary = json.loads((out / "summary.json").read_text())
    choice, second_tier = summary["tiers"]
    assert choice["rows"] == len(ids) and choice["accepted"] + choice["escalated"] == len(ids)
    assert second_tier["rows"] == choice["escalated"] == second_tier["accepted"] == len(free)
    assert summary["usd"] > 0 and summary["last_tier_alone"]["usd"] > 0
    assert "the last tier alone" in done.stdout


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines()]
