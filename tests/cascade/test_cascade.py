"""`tokenmill cascade` end to end on a scripted OpenAI-compatible endpoint whose answers, log-
probabilities and token counts are known, so which rows go on, the cost of each tier and the
saving are exact; kill -9 during the second tier; bad input before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.conftest import read_jsonl, write_jsonl
from tests.jobs.stub_server import StubServer
from tokenmill.cli import main

LABELS = ["positive", "negative", "mixed"]
ROWS = 10
CONFIDENT = {0, 1, 2, 9}  # the rows the cheap model answers with logprob -0.1 (the rest: -2.0)
# The stub's usage for the prompt "review i" (2 words): 7 prompt tokens, 3 completion tokens a row.
PROMPT, COMPLETION = 7, 3


def truth(i: int) -> str:
    return LABELS[i % 3]


def answer(body: dict[str, Any], key: str) -> str:
    """The cheap model is right on rows 0-2 only; the dear one on every row."""
    i = int(key.split()[-1])
    right = body.get("model") == "dear" or i < 3
    return truth(i) if right else truth(i + 1)


def logprobs(body: dict[str, Any], key: str) -> dict[str, Any]:
    i = int(key.split()[-1])
    lp = -0.1 if i in CONFIDENT or body.get("model") == "dear" else -2.0
    top = [{"token": "x", "logprob": lp, "bytes": [120]}]
    return {"content": [{"token": "x", "logprob": lp, "bytes": [120], "top_logprobs": top}]}


@pytest.fixture
def job(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "job.jsonl", [{"id": f"r{i}", "prompt": f"review {i}"} for i in range(ROWS)])


@pytest.fixture
def stub() -> Any:
    with StubServer(answer=answer, logprobs=logprobs) as server:
        yield server


def tier(stub: StubServer, model: str, per_m_in: float, per_m_out: float) -> str:
    return (f"{model}=--endpoint {stub.url} --model {model} --retry-for 5 "
            f"--price-per-m-input {per_m_in} --price-per-m-output {per_m_out}")


def cascade(job: Path, out: Path, *args: str) -> int:
    return main(["cascade", str(job), "-o", str(out), "--no-progress", *args])


def test_only_rejected_rows_reach_the_dear_tier_and_the_saving_is_exact(stub: StubServer, job: Path,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = cascade(job, out, "--tier", tier(stub, "cheap", 1, 2), "--tier", tier(stub, "dear", 10, 20),
                   "--accept", "min-logprob>=-1")
    assert code == 0
    rows = {r["custom_id"]: r for r in read_jsonl(out / "results.jsonl")}
    assert sorted(rows) == sorted(f"r{i}" for i in range(ROWS))  # every row once
    for i in range(ROWS):
        row = rows[f"r{i}"]
        kept_cheap = i in CONFIDENT
        assert row["cascade"]["tier"] == ("cheap" if kept_cheap else "dear")
        assert row["cascade"]["rejected_by"] == ([] if kept_cheap else
                                                 [{"tier": "cheap", "reason": "min-logprob -2 < -1"}])
    # The dear tier saw only the rejected rows, and asked for no logprobs (it is last: nothing checks it).
    dear_bodies = [b for b in stub.bodies if b["model"] == "dear"]
    assert sorted(b["messages"][-1]["content"] for b in dear_bodies) == sorted(
        f"review {i}" for i in range(ROWS) if i not in CONFIDENT)
    assert all("logprobs" not in b for b in dear_bodies)
    assert all(b["logprobs"] is True for b in stub.bodies if b["model"] == "cheap")
    # The rejected answers are kept for audit, with why.
    audit = read_jsonl(out / "tiers" / "cheap" / "rejected.jsonl")
    assert sorted(r["custom_id"] for r in audit) == sorted(f"r{i}" for i in range(ROWS) if i not in CONFIDENT)
    summary = json.loads((out / "summary.json").read_text())
    cheap, dear = summary["tiers"]
    assert (cheap["rows"], cheap["answered"], cheap["accepted"], cheap["escalated"]) == (10, 10, 4, 6)
    assert (dear["rows"], dear["answered"], dear["accepted"], dear["escalated"]) == (6, 6, 6, 0)
    assert cheap["rejections"] == {"min-logprob < -1": 6}
    cheap_usd = 10 * (PROMPT * 1 + COMPLETION * 2) / 1e6
    dear_usd = 6 * (PROMPT * 10 + COMPLETION * 20) / 1e6
    assert cheap["usd"] == pytest.approx(cheap_usd, abs=1e-12) and dear["usd"] == pytest.approx(dear_usd, abs=1e-12)
    assert summary["usd"] == pytest.approx(cheap_usd + dear_usd, abs=1e-12)
    alone = 10 * (PROMPT * 10 + COMPLETION * 20) / 1e6  # the dear tier's cost per row × every row
    assert summary["last_tier_alone"]["usd"] == pytest.approx(alone, abs=1e-12)
    assert summary["saving"] == pytest.approx(1 - (cheap_usd + dear_usd) / alone)  # 0.3


def test_a_rerun_of_a_finished_cascade_sends_nothing(stub: StubServer, job: Path, tmp_path: Path) -> None:
    args = ("--tier", tier(stub, "cheap", 1, 2), "--tier", tier(stub, "dear", 10, 20), "--accept", "min-logprob>=-1")
    assert cascade(job, tmp_path / "out", *args) == 0
    sent = len(stub.bodies)
    first = read_jsonl(tmp_path / "out" / "results.jsonl")
    assert cascade(job, tmp_path / "out", *args) == 0
    assert len(stub.bodies) == sent
    assert sorted(r["custom_id"] for r in read_jsonl(tmp_path / "out" / "results.jsonl")) == sorted(
        r["custom_id"] for r in first)


def test_parses_sends_on_answers_outside_the_choice(stub: StubServer, job: Path, tmp_path: Path) -> None:
    """The cheap tier's choice is one label short, so its (unconstrained, scripted) answers "mixed" fail `parses`."""
    out = tmp_path / "out"
    cheap = tier(stub, "cheap", 1, 2) + " --choice positive,negative"
    assert cascade(job, out, "--tier", cheap, "--tier", tier(stub, "dear", 10, 20), "--accept", "parses") == 0
    rows = read_jsonl(out / "results.jsonl")
    cheap_answers = {f"r{i}": answer({"model": "cheap"}, f"review {i}") for i in range(ROWS)}
    for row in rows:
        expected = "dear" if cheap_answers[row["custom_id"]] == "mixed" else "cheap"
        assert row["cascade"]["tier"] == expected
        if expected == "dear":
            assert row["cascade"]["rejected_by"][0]["reason"] == "not one of the choices"


@pytest.mark.parametrize(("args", "message"), [
    (["--accept", "min-logprob>=-1"], "at least two --tier"),
    (["--tier", "dear=--price-per-hour 1", "--accept", "min-logprob>=0.5"], "must be in (-inf, 0]"),
    (["--tier", "dear=--price-per-hour 1", "--accept", "margin>=2"], "must be in [0, 1]"),
    (["--tier", "dear=--price-per-hour 1", "--accept", "min-logprob"], "needs a threshold"),
    (["--tier", "dear=--price-per-hour 1", "--accept", "confidence>=0.5"], "unknown check"),
    (["--tier", "dear=--price-per-hour 1", "--accept", "parses"], "needs the tier to ask for a structured output"),
    (["--tier", "cheap=--price-per-hour 1", "--accept", "parses"], "--tier names must differ"),
])
def test_bad_cascades_are_refused_before_any_work(job: Path, tmp_path: Path, capsys: Any, args: list[str],
                                                  message: str) -> None:
    code = cascade(job, tmp_path / "out", "--tier", "cheap=--price-per-hour 0.1", *args)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "tiers").exists()


def test_kill_during_the_second_tier_then_rerun_answers_every_row_exactly_once(job: Path, tmp_path: Path) -> None:
    """kill -9 of the cascade while the dear tier is part way; the re-run finishes it without sending
    the cheap tier anything, and no row is answered twice by either tier."""
    with StubServer(answer=answer, logprobs=logprobs, delay=0.3) as stub:
        out = tmp_path / "out"
        cmd = [sys.executable, "-m", "tokenmill", "cascade", str(job), "-o", str(out), "--no-progress",
               "--tier", tier(stub, "cheap", 1, 2) + " --concurrency 16",
               "--tier", tier(stub, "dear", 10, 20) + " --concurrency 1", "--accept", "min-logprob>=-1"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        dear_results = out / "tiers" / "dear" / "results.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _lines(dear_results) < 2:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert dear_results.exists(), "the dear tier never started"
        cheap_sent = sum(b["model"] == "cheap" for b in stub.bodies)
        assert subprocess.run(cmd, capture_output=True).returncode == 0
        assert sum(b["model"] == "cheap" for b in stub.bodies) == cheap_sent == ROWS  # not re-run
        dear_keys = [b["messages"][-1]["content"] for b in stub.bodies if b["model"] == "dear"]
    rows = read_jsonl(out / "results.jsonl")
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(ROWS))
    dear_rows = read_jsonl(dear_results)
    assert len(dear_rows) == len({r["custom_id"] for r in dear_rows}) == ROWS - len(CONFIDENT)
    # At most the requests in flight at the kill were sent twice; no row has two answers.
    assert len(dear_keys) - len(set(dear_keys)) <= 1


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _tiers(stub: StubServer) -> list[str]:
    return ["--tier", tier(stub, "cheap", 1, 2), "--tier", tier(stub, "dear", 10, 20), "--accept", "min-logprob>=-1"]


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("where", ["results.jsonl", "errors.jsonl", "summary.json", "cascade.json",
                                   "tiers/cheap/results.jsonl", "tiers/dear/input.jsonl"])
def test_a_cascade_never_writes_over_its_input(stub: StubServer, job: Path, tmp_path: Path, capsys: Any,
                                               where: str, overwrite: list[str]) -> None:
    out = tmp_path / "out"
    inside = out / where
    inside.parent.mkdir(parents=True)
    job.rename(inside)
    before = inside.read_bytes()
    assert cascade(inside, out, *_tiers(stub), *overwrite) == 2
    err = capsys.readouterr().err
    assert "destroy its own input" in err and str(inside) in err
    assert inside.read_bytes() == before and not stub.bodies


def test_a_cascade_rerun_on_an_input_edited_in_place_is_refused(stub: StubServer, job: Path, tmp_path: Path,
                                                                 capsys: Any) -> None:
    out = tmp_path / "out"
    assert cascade(job, out, *_tiers(stub)) == 0
    write_jsonl(job, [{"id": f"n{i}", "prompt": f"review {i}"} for i in range(ROWS)])  # same path, new rows
    sent = len(stub.bodies)
    assert cascade(job, out, *_tiers(stub)) == 2
    assert "the input's contents" in capsys.readouterr().err and len(stub.bodies) == sent
    assert cascade(job, out, *_tiers(stub), "--overwrite") == 0
    assert sorted(r["custom_id"] for r in read_jsonl(out / "results.jsonl")) == sorted(f"n{i}" for i in range(ROWS))


def test_a_finished_tier_is_rerun_only_on_the_rows_it_finished(stub: StubServer, job: Path, tmp_path: Path,
                                                                capsys: Any) -> None:
    out = tmp_path / "out"
    assert cascade(job, out, *_tiers(stub)) == 0
    handed_on = out / "tiers" / "dear" / "input.jsonl"
    handed_on.write_text(handed_on.read_text().replace("review", "edited"))
    assert cascade(job, out, *_tiers(stub)) == 2
    assert "tier dear finished on another" in capsys.readouterr().err


def test_a_cascade_recorded_before_input_identities_is_resumed(stub: StubServer, job: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cascade(job, out, *_tiers(stub)) == 0
    record = json.loads((out / "cascade.json").read_text())
    del record["input_identity"]
    (out / "cascade.json").write_text(json.dumps(record))
    sent = len(stub.bodies)
    assert cascade(job, out, *_tiers(stub)) == 0 and len(stub.bodies) == sent
    assert "input_identity" in json.loads((out / "cascade.json").read_text())


def test_a_duplicate_id_keeps_its_error_row_and_its_twin_its_answer(stub: StubServer, job: Path,
                                                                     tmp_path: Path) -> None:
    """r1 is answered confidently by the cheap tier; a second line with id r1 is a bad line, which
    must neither be lost nor send the first r1 on to the dear tier."""
    rows = [{"id": f"r{i}", "prompt": f"review {i}"} for i in range(ROWS)] + [{"id": "r1", "prompt": "review 5"}]
    write_jsonl(job, rows)
    out = tmp_path / "out"
    assert cascade(job, out, *_tiers(stub)) == 1  # a row failed
    results, errors = read_jsonl(out / "results.jsonl"), read_jsonl(out / "errors.jsonl")
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(ROWS))
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("r1", "invalid_input")]
    assert errors[0]["error"]["message"].startswith(f"line {ROWS + 1}: ")
    assert next(r for r in results if r["custom_id"] == "r1")["cascade"]["tier"] == "cheap"


def test_a_second_cascade_on_a_folder_is_refused(stub: StubServer, job: Path, tmp_path: Path, capsys: Any) -> None:
    from tokenmill.jobs.journal.guard import OutputLock

    out = tmp_path / "out"
    with OutputLock(out / "results.lock", out):  # as a cascade still running on it holds it
        assert cascade(job, out, *_tiers(stub)) == 2
    assert "being written by another tokenmill" in capsys.readouterr().err and not stub.bodies
    assert cascade(job, out, *_tiers(stub)) == 0
