"""`tokenmill split`: any input → OpenAI Batch API files within the limits, bad lines apart."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import main
from tokenmill.jobs.input.reader import read_input
from tokenmill.jobs.input.request import DocumentOptions


def parts_of(out: Path) -> list[list[dict[str, Any]]]:
    return [[json.loads(line) for line in p.read_text().splitlines()] for p in sorted(out.glob("part-*.jsonl"))]


def assert_valid_parts(out: Path, max_requests: int, max_bytes: int) -> list[dict[str, Any]]:
    """Each part a Batch API input file within the limits, of one url; returns all their lines."""
    lines = []
    for path in sorted(out.glob("part-*.jsonl")):
        data = path.read_bytes()
        rows = [json.loads(line) for line in data.splitlines()]
        assert data.endswith(b"\n") and len(data) <= max_bytes and len(rows) <= max_requests, path
        assert all(set(r) == {"custom_id", "method", "url", "body"} and r["method"] == "POST" for r in rows)
        assert len({r["url"] for r in rows}) == 1, f"{path} mixes endpoints"
        spec = read_input(path, DocumentOptions(), "batch")  # what `tokenmill run` and a server accept
        assert not spec.errors and len(spec.entries) == len(rows)
        lines += rows
    return lines


def test_a_text_file_is_cut_into_parts_with_every_line_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = [f"document number {i}" for i in range(1, 24)]
    (tmp_path / "in.txt").write_text("\n".join(docs[:10]) + "\n\n" + "\n".join(docs[10:]) + "\n")  # a blank line
    out = tmp_path / "parts"
    code = main(["split", str(tmp_path / "in.txt"), "-o", str(out), "--max-requests", "5", "--max-bytes", "100000",
                 "--system", "Summarise.", "--max-tokens", "16", "--model", "gpt-4o-mini"])
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    lines = assert_valid_parts(out, 5, 100_000)
    assert [len(p) for p in parts_of(out)] == [5, 5, 5, 5, 3]
    assert len(printed) == 5 and printed[0].startswith(f"{out / 'part-00001.jsonl'}  5 request(s)  ")
    # Line numbers as `run` counts them: the blank line keeps its number.
    assert [r["custom_id"] for r in lines] == [f"line-{n}" for n in [*range(1, 11), *range(12, 25)]]
    body = lines[0]["body"]
    assert body["model"] == "gpt-4o-mini" and body["max_tokens"] == 16
    assert body["messages"] == [{"role": "system", "content": "Summarise."},
                                {"role": "user", "content": "document number 1"}]
    assert not (out / "errors.jsonl").exists()


def test_bad_and_too_big_lines_go_to_errors_with_their_line_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [json.dumps({"id": "a", "prompt": "short"}), "not json", json.dumps({"id": "b", "prompt": "y" * 900}),
            json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}]}),
            json.dumps({"id": "a", "prompt": "again"})]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "parts"
    code = main(["split", str(tmp_path / "in.jsonl"), "-o", str(out), "--max-bytes", "600", "--max-requests", "10"])
    err = capsys.readouterr().err
    assert code == 1 and "3 bad line(s)" in err
    assert [r["custom_id"] for r in assert_valid_parts(out, 10, 600)] == ["a", "c"]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["error"]["message"].split(":")[0] for e in errors] == ["line 2", "line 3", "line 5"]
    assert all(e["error"]["code"] == "invalid_input" for e in errors)
    assert "over the 600-byte limit" in errors[1]["error"]["message"] and "--max-bytes" in errors[1]["error"]["message"]
    assert "duplicate custom_id" in errors[2]["error"]["message"]


def test_a_csv_and_a_mixed_batch_file_keep_one_endpoint_a_part(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text('ticket,body\nT1,"Refund, please"\nT2,The app crashes\n')
    out = tmp_path / "csv"
    assert main(["split", str(tmp_path / "t.csv"), "-o", str(out), "--id-column", "ticket", "--prompt-column",
                 "body", "--template", "Ticket: {text}", "--completions"]) == 0
    lines = assert_valid_parts(out, 50_000, 200 * 1024 * 1024)
    assert [(r["custom_id"], r["url"], r["body"]["prompt"]) for r in lines] == [
        ("T1", "/v1/completions", "Ticket: Refund, please"), ("T2", "/v1/completions", "Ticket: The app crashes")]

    batch = [{"custom_id": f"r{i}", "method": "POST", "url": url, "body": body} for i, (url, body) in enumerate([
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ("/v1/completions", {"prompt": "b"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "c"}]})])]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in batch))
    assert main(["split", str(tmp_path / "b.jsonl"), "-o", str(tmp_path / "mixed")]) == 0
    assert [[r["custom_id"] for r in p] for p in parts_of(tmp_path / "mixed")] == [["r0", "r2"], ["r1"]]


def test_an_earlier_split_is_refused_or_replaced_and_limits_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("one\ntwo\nthree\n")
    out = tmp_path / "parts"
    assert main(["split", str(tmp_path / "in.txt"), "-o", str(out), "--max-requests", "1"]) == 0
    assert main(["split", str(tmp_path / "in.txt"), "-o", str(out)]) == 2
    assert "already holds part-00001.jsonl" in capsys.readouterr().err
    assert main(["split", str(tmp_path / "in.txt"), "-o", str(out), "--overwrite"]) == 0
    assert [len(p) for p in parts_of(out)] == [3]  # no part of the earlier split left beside it
    assert sorted(p.name for p in out.iterdir()) == ["part-00001.jsonl"]
    assert main(["split", str(tmp_path / "in.txt"), "-o", str(tmp_path / "x"), "--max-requests", "0"]) == 2
    assert "--max-requests must be positive" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was written


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize("name", ["part-00001.jsonl", "errors.jsonl"])
def test_a_split_never_writes_over_its_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                             overwrite: list[str]) -> None:
    out = tmp_path / "parts"
    out.mkdir()
    path = out / name
    path.write_text("".join(json.dumps({"prompt": f"document {i}"}) + "\n" for i in range(5)))
    before = path.read_bytes()
    assert main(["split", str(path), "-o", str(out), "--max-requests", "2", "--model", "m", *overwrite]) == 2
    err = capsys.readouterr().err
    assert "destroy its own input" in err and str(path) in err
    assert path.read_bytes() == before and sorted(p.name for p in out.iterdir()) == [name]


def test_a_second_split_into_a_folder_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tokenmill.jobs.journal.guard import OutputLock

    (tmp_path / "in.txt").write_text("one\ntwo\n")
    out = tmp_path / "parts"
    out.mkdir()
    with OutputLock(out, out):  # a split locks the folder itself, so nothing but parts lies in it
        assert main(["split", str(tmp_path / "in.txt"), "-o", str(out), "--model", "m"]) == 2
    assert f"being written by another tokenmill (pid {os.getpid()}; lock {out})" in capsys.readouterr().err
    assert not list(out.iterdir())
    assert main(["split", str(tmp_path / "in.txt"), "-o", str(out), "--model", "m"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["part-00001.jsonl"]
