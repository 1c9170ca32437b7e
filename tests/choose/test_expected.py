"""The expected-answers file: ids and answers read, every bad line named by file and line; the job's
ids compared with the expected ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.choose.expected import ExpectedError, IdCheck, compare_ids, read_expected


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "expected.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_ids_and_answers_in_every_form(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {"custom_id": "review-001", "label": "positive"},  # the one field left is the answer
        {"id": 7, "expected": {"a": 1}},  # an int id becomes a string; any JSON value
        "",
        "   ",
        {"custom_id": "r-3", "expected": 3.5, "note": "ignored: expected says which"},
        {"custom_id": "r-4", "id": 99, "answer": None},  # both id keys set aside; null is an answer
    )
    assert read_expected(path) == {"review-001": "positive", "7": {"a": 1}, "r-3": 3.5, "r-4": None}
    assert list(read_expected(path)) == ["review-001", "7", "r-3", "r-4"]  # file order


def test_a_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "expected": "x"}\n')
    assert read_expected(path) == {"a": "x"}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"custom_id": "a" "expected": 1}', "line 3: not JSON (Expecting ',' delimiter"),
        ("[1, 2]", "line 3: expected a JSON object"),
        ('{"expected": "x"}', 'line 3: no "custom_id" (or "id")'),
        ('{"custom_id": "c", "a": 1, "b": 2}', 'line 3: no "expected" field and 2 other fields ("a", "b"): say which'),
        ('{"custom_id": "c"}', "line 3: no expected answer (only an id)"),
        ('{"custom_id": true, "expected": 1}', 'line 3: "custom_id" must be a non-empty string or an integer'),
        ('{"id": "", "expected": 1}', 'line 3: "id" must be a non-empty string or an integer'),
        ('{"id": [1], "expected": 1}', 'line 3: "id" must be'),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write(tmp_path, {"id": "x", "expected": 1}, "", line, {"id": "y", "expected": 2})
    with pytest.raises(ExpectedError) as info:
        read_expected(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_a_duplicate_id_names_both_lines(tmp_path: Path) -> None:
    path = write(tmp_path, {"id": "w", "expected": 0}, {"custom_id": "x", "expected": 1}, "",
                 {"id": "z", "expected": 2}, {"id": "x", "expected": 3})
    with pytest.raises(ExpectedError, match=r'line 5: duplicate id "x" \(first on line 2\)'):
        read_expected(path)


def test_an_int_id_and_its_string_are_the_same_id(tmp_path: Path) -> None:
    path = write(tmp_path, {"id": 1, "expected": "a"}, {"id": "1", "expected": "b"})
    with pytest.raises(ExpectedError, match=r'line 2: duplicate id "1"'):
        read_expected(path)


def test_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "a", "expected": "x"}\n{"id": "b", "expected": "caf\xe9"}\n')
    with pytest.raises(ExpectedError, match="line 2: not UTF-8"):
        read_expected(path)


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_expected(tmp_path / "nope.jsonl")
    blank = write(tmp_path, "", "  ")
    with pytest.raises(ExpectedError, match="no expected answers"):
        read_expected(blank)


def test_compare_ids_keeps_each_side_in_its_order() -> None:
    check = compare_ids(["j3", "j1", "j2", "j4"], {"j2": 1, "x9": 2, "j1": 3, "x1": 4})
    assert check == IdCheck(missing=["j3", "j4"], unknown=["x9", "x1"])
    assert check.warnings() == [
        "2 job row(s) have no expected answer (first: j3, j4); they are left out of the sample",
        "2 expected id(s) are not in the job (first: x9, x1)",
    ]


def test_warnings_list_only_the_first_few() -> None:
    job = [f"r{i}" for i in range(12)]
    check = compare_ids(job, {"zz": 1})
    missing, unknown = check.warnings()
    assert missing == (
        "12 job row(s) have no expected answer (first: r0, r1, r2, r3, r4, …); they are left out of the sample"
    )
    assert unknown == "1 expected id(s) are not in the job (first: zz)"
    assert check.warnings(max_listed=2)[0].startswith("12 job row(s) have no expected answer (first: r0, r1, …)")
    assert check.warnings(max_listed=0)[1] == "1 expected id(s) are not in the job"


def test_no_warnings_when_ids_match() -> None:
    check = compare_ids(iter(["a", "b"]), {"b": 1, "a": 2})
    assert check == IdCheck([], [])
    assert check.warnings() == []
