"""`tokenmill choose` end to end: candidates on a scripted OpenAI-compatible endpoint whose answers
are known (so every quality figure is exact), resume after a kill, bad input, and the embedded
engine on a small sample."""

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
from tokenmill.choose.stats import wilson
from tokenmill.cli import main

LABELS = ["positive", "negative", "mixed"]
ROWS = 10


def truth(i: int) -> str:
    return LABELS[i % 3]


def answers_right(model: str) -> int:
    """How many of the first rows each scripted model gets right."""
    return {"good": 7, "bad": 3, "perfect": ROWS}.get(model, 0)


def scripted(body: dict[str, Any], key: str) -> str:
    """The answer a scripted model gives to "review i": the true label for its first n rows, a wrong
    one after; the judge model grades every answer 8 of 10."""
    if body.get("model") == "judge":
        return "The answer matches the reference.\nSCORE: 8"
    i = int(key.split()[-1])
    label = truth(i) if i < answers_right(body.get("model", "")) else truth(i + 1)
    return f"{label.capitalize()} | a summary of review {i}"


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, Path]:
    rows = [{"id": f"r{i}", "prompt": f"review {i}"} for i in range(ROWS)]
    expected = [{"custom_id": f"r{i}", "label": truth(i)} for i in range(ROWS)]
    return write_jsonl(tmp_path / "job.jsonl", rows), write_jsonl(tmp_path / "expected.jsonl", expected)


@pytest.fixture
def stub() -> Any:
    with StubServer(answer=scripted) as server:
        yield server


def endpoint(stub: StubServer, model: str, *extra: str) -> str:
    return f"{model}=--endpoint {stub.url} --model {model} --retry-for 5 {' '.join(extra)}"


def choose(job: tuple[Path, Path], out: Path, *args: str) -> int:
    return main(["choose", str(job[0]), "--expected", str(job[1]), "-o", str(out), "--no-progress",
                 "--scorer", "label", *args])


def report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in data["candidates"]}


def test_quality_is_exact_and_the_cheapest_that_clears_is_chosen(stub: StubServer, job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = choose(job, out, "--min-quality", "0.6", "--clear-by", "mean",
                  "--candidate", endpoint(stub, "good", "--price-per-m-input 1 --price-per-m-output 2"),
                  "--candidate", endpoint(stub, "bad", "--price-per-m-input 0.1 --price-per-m-output 0.2"),
                  "--candidate", endpoint(stub, "perfect", "--price-per-m-input 10 --price-per-m-output 20"))
    assert code == 0
    data = report(out)
    good, bad, perfect = (by_name(data)[n] for n in ("good", "bad", "perfect"))
    assert good["quality"]["mean"] == pytest.approx(0.7)
    assert (good["quality"]["low"], good["quality"]["high"]) == pytest.approx(wilson(7, 10))
    assert good["quality"]["method"] == "wilson" and good["notes"] == {"wrong label": 3}
    assert bad["quality"]["mean"] == pytest.approx(0.3) and perfect["quality"]["mean"] == 1.0
    # The stub's usage: prompt = words + 5, completion = words + 1 for the prompt "review i" (2 words).
    assert (good["prompt_tokens"], good["output_tokens"]) == (70, 30)
    assert good["usd_per_m_output"] == pytest.approx((70 * 1 + 30 * 2) / 30)
    assert good["projected"]["usd"] == pytest.approx((70 * 1 + 30 * 2) / 1e6)  # the sample is the whole job
    assert data["verdict"]["chosen"] == "good"  # bad is cheaper but below the bar, perfect clears but costs more
    assert data["verdict"]["clears"] == ["good", "perfect"]
    for name in ("report.md", "report.png"):
        assert (out / name).stat().st_size > 0
    assert "good" in (out / "report.md").read_text()


def test_by_the_lower_bound_a_small_sample_straddles(stub: StubServer, job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", "0.6", "--candidate", endpoint(stub, "good", "--price-per-hour 1")) == 0
    verdict = report(out)["verdict"]
    assert verdict["chosen"] is None and verdict["straddles"] == ["good"]  # 0.7, interval [0.40, 0.89]
    assert "sample more" in verdict["message"]


def test_the_sample_is_seeded_the_same_for_every_candidate_and_kept(stub: StubServer, job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--min-quality", "0.5", "--sample", "4", "--seed", "3",
            "--candidate", endpoint(stub, "good"), "--candidate", endpoint(stub, "bad")]
    assert choose(job, out, *args) == 0
    ids = {n: sorted(r["custom_id"] for r in read_jsonl(out / "candidates" / n / "results.jsonl"))
           for n in ("good", "bad")}
    assert ids["good"] == ids["bad"] and len(ids["good"]) == 4
    sent = sum(stub.attempts.values())
    assert choose(job, out, *args) == 0  # a re-run finds both done: nothing is sent again
    assert sum(stub.attempts.values()) == sent
    assert report(out)["sample"] == 4 and report(out)["job_rows"] == ROWS
    assert choose(job, out, *[a if a != "3" else "4" for a in args]) == 2  # another seed, same folder


def test_a_candidate_whose_endpoint_is_down_gets_its_reason_and_the_others_go_on(
    stub: StubServer, job: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    dead = "dead=--endpoint http://127.0.0.1:9/v1 --model good"  # port 9 (discard): nothing listens
    assert choose(job, out, "--min-quality", "0.5", "--candidate", dead,
                  "--candidate", endpoint(stub, "good")) == 1
    rows = by_name(report(out))
    assert rows["dead"]["status"] == "failed" and "endpoint down" in rows["dead"]["reason"]
    assert rows["dead"]["quality"] is None and rows["dead"]["projected"] is None
    assert rows["good"]["status"] == "done" and rows["good"]["price"]["per_hour"] is None  # no price: unknown
    assert rows["good"]["projected"]["usd"] is None and rows["good"]["quality"]["mean"] == pytest.approx(0.7)


def test_expected_ids_that_do_not_match_are_reported_and_only_labelled_rows_are_sampled(
    stub: StubServer, job: Any, tmp_path: Path
) -> None:
    rows = read_jsonl(job[1])
    write_jsonl(job[1], rows[2:] + [{"custom_id": "stranger", "label": "mixed"}])
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", "0.5", "--candidate", endpoint(stub, "good")) == 0
    data = report(out)
    assert any("2 job row(s) have no expected answer" in w and "r0, r1" in w for w in data["warnings"])
    assert any("1 expected id(s) are not in the job" in w for w in data["warnings"])
    assert data["sample"] == 8 and data["job_rows"] == ROWS
    assert by_name(data)["good"]["quality"]["mean"] == pytest.approx(5 / 8)  # r2..r6 right, r7..r9 wrong


def test_a_scorer_that_raises_names_the_row_and_a_rerun_rescores_without_running_again(
    stub: StubServer, job: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scorer = tmp_path / "my_scorer.py"
    scorer.write_text("def score(answer, expected):\n    if 'review 4' in answer:\n        raise KeyError('oops')\n"
                      "    return expected in answer.lower()\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    args = ["--min-quality", "0.5", "--candidate", endpoint(stub, "good")]
    assert choose(job, out, *args[:2], "--scorer", f"python:{scorer}:score", *args[2:]) == 2
    assert "r4" in capsys.readouterr().err
    sent = sum(stub.attempts.values())
    scorer.write_text("def score(answer, expected):\n    return expected in answer.lower()\n")
    assert choose(job, out, *args[:2], "--scorer", f"python:{scorer}:score", *args[2:]) == 0
    assert sum(stub.attempts.values()) == sent
    assert by_name(report(out))["good"]["quality"]["mean"] == pytest.approx(0.7)


def test_the_judge_grades_every_answer_through_an_endpoint_job(stub: StubServer, job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", "0.75", "--clear-by", "mean", "--scorer", "judge",
                  "--judge-endpoint", stub.url, "--judge-model", "judge",
                  "--candidate", endpoint(stub, "good", "--price-per-hour 1")) == 0
    good = by_name(report(out))["good"]
    assert good["quality"]["mean"] == pytest.approx(0.8) and good["quality"]["method"] == "bootstrap"
    judged = [b["messages"][0]["content"] for b in stub.bodies if b.get("model") == "judge"]
    assert len(judged) == ROWS  # the task, the answer and the reference are in each judge request
    assert any("user: review 0\n" in j and "Positive | a summary of review 0" in j and "positive" in j
               for j in judged)
    assert len(read_jsonl(out / "judge" / "good" / "results.jsonl")) == ROWS
    assert report(out)["verdict"]["chosen"] == "good"


@pytest.mark.parametrize(("candidate", "message"), [
    ("x=--no-such-flag", "--candidate x: unrecognized arguments: --no-such-flag"),
    ("x=-o elsewhere", "-o is set by choose"),
    ("bad name=--max-tokens 4", "expected NAME=FLAGS"),
    ("x=--choice a --regex b", "--candidate x"),
    ("x=--price-per-hour 1 --price-per-m-input 1 --price-per-m-output 1", "by the hour or by the token"),
    ("x=--price-per-m-input 1", "needs both"),
])
def test_candidate_flags_are_checked_before_anything_runs(
    job: Any, tmp_path: Path, candidate: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert choose(job, tmp_path / "out", "--min-quality", "0.5", "--candidate", candidate) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_killed_choose_resumes_where_it_stopped(job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "tokenmill", "choose", str(job[0]), "--expected", str(job[1]), "-o", str(out),
            "--no-progress", "--scorer", "label", "--min-quality", "0.5"]
    with StubServer(answer=scripted, delay=0.3) as stub:
        cands = ["--candidate", endpoint(stub, "good", "--concurrency 1"),
                 "--candidate", endpoint(stub, "bad", "--concurrency 1")]
        proc = subprocess.Popen([*argv, *cands], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
        results = out / "candidates" / "good" / "results.jsonl"
        deadline = time.monotonic() + 60
        while len(read_jsonl(results)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done_before = len(read_jsonl(results))
        assert 4 <= done_before < ROWS
        sent_before = sum(stub.attempts.values())
        assert main(["choose", *argv[4:], *cands]) == 0
    for name in ("good", "bad"):
        ids = [r["custom_id"] for r in read_jsonl(out / "candidates" / name / "results.jsonl")]
        assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))  # each row once
    resent = sum(stub.attempts.values()) - sent_before - ROWS  # bad ran all its rows after the kill
    assert ROWS - done_before <= resent <= ROWS - done_before + 1  # at most the one row in flight at the kill
    assert by_name(report(out))["good"]["quality"]["mean"] == pytest.approx(0.7)


def test_a_candidate_whose_flags_changed_under_the_same_name_is_refused_not_mixed(
    stub: StubServer, job: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert choose(job, out, "--min-quality", "0.5", "--candidate", endpoint(stub, "good")) == 0
    assert choose(job, out, "--min-quality", "0.5", "--candidate", endpoint(stub, "good", "--max-tokens 5"),
                  "--candidate", endpoint(stub, "bad")) == 1
    rows = by_name(report(out))
    assert rows["good"]["status"] == "failed" and "max_tokens was unset, now 5" in rows["good"]["reason"]
    assert rows["bad"]["status"] == "done"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize(("which", "where"), [
    (0, "sample.jsonl"), (0, "candidates/good/results.jsonl"), (1, "choose.json"), (1, "report.json"),
    (1, "judge/good/requests.jsonl"),
])
def test_choose_never_writes_over_its_job_or_expected_file(stub: StubServer, job: tuple[Path, Path], tmp_path: Path,
                                                          capsys: Any, which: int, where: str,
                                                          overwrite: list[str]) -> None:
    out = tmp_path / "out"
    inside = out / where
    inside.parent.mkdir(parents=True)
    job[which].rename(inside)
    moved = (inside, job[1]) if which == 0 else (job[0], inside)
    before = inside.read_bytes()
    assert choose(moved, out, "--min-quality", "0.5", "--candidate", endpoint(stub, "good"), *overwrite) == 2
    err = capsys.readouterr().err
    assert "destroy its own input" in err and str(inside) in err
    assert inside.read_bytes() == before and not stub.bodies


def test_a_second_choose_on_a_folder_is_refused(stub: StubServer, job: tuple[Path, Path], tmp_path: Path,
                                                capsys: Any) -> None:
    from tokenmill.jobs.journal.guard import OutputLock

    out = tmp_path / "out"
    with OutputLock(out / "results.lock", out):
        assert choose(job, out, "--min-quality", "0.5", "--candidate", endpoint(stub, "good")) == 2
    assert "being written by another tokenmill" in capsys.readouterr().err and not stub.bodies
