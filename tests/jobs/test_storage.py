"""Input and output on an object store: a real S3-compatible server (moto's, started as its own
process on 127.0.0.1), reached the way a user reaches one (AWS_ENDPOINT_URL and credentials in the
environment); the model is tests/jobs/stub_server.py. Exactly once across a kill -9 with the spool
kept, with it lost, and with a stale spool coming back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill.cli import main
from tokenmill.jobs import storage
from tokenmill.jobs.storage import StorageError

from .conftest import batch_line
from .stub_server import StubServer

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

ROWS = 30
PART_ROWS = 4


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """moto's S3 server, and the environment any S3 client (botocore, s3fs) finds it by."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto's server did not start"
            time.sleep(0.05)
    saved = dict(os.environ)
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    for name in ("AWS_PROFILE", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        os.environ.pop(name, None)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield url
    finally:
        os.environ.clear()
        os.environ.update(saved)
        s3fs.S3FileSystem.clear_instance_cache()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def bucket(s3_server: str) -> str:
    """A fresh bucket holding the job's input, s3://BUCKET/in.jsonl: ROWS requests and one bad line."""
    name = f"tm-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(name)
    lines = [json.dumps(batch_line(f"r-{i:02d}", f"question {i}")) for i in range(ROWS)]
    lines.insert(5, "not json")
    fs.pipe_file(f"{name}/in.jsonl", ("\n".join(lines) + "\n").encode())
    return name


def rows_on_s3(bucket: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The custom_ids of every committed part's rows, and the uploaded error rows."""
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    ids = []
    for path in sorted(fs.ls(f"{bucket}/out/results", detail=False)):
        ids += [json.loads(line)["custom_id"] for line in fs.cat_file(path).splitlines()]
    errors = [json.loads(line) for line in fs.cat_file(f"{bucket}/out/errors.jsonl").splitlines()]
    return ids, errors


def assert_exactly_once_on_s3(bucket: str) -> None:
    ids, errors = rows_on_s3(bucket)
    assert sorted(ids) == [f"r-{i:02d}" for i in range(ROWS)], "each row in exactly one committed part"
    assert [e["error"]["code"] for e in errors] == ["invalid_input"]


def flags(bucket: str, stub: StubServer, spool: Path, *more: str) -> list[str]:
    return ["run", f"s3://{bucket}/in.jsonl", "-o", f"s3://{bucket}/out/", "--endpoint", stub.url,
            "--spool-dir", str(spool), "--part-rows", str(PART_ROWS), "--max-tokens", "4", "--no-progress", *more]


def test_a_job_reads_and_writes_s3(bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StubServer() as stub:
        assert main(flags(bucket, stub, tmp_path / "spool")) == 1  # the bad line failed
        assert_exactly_once_on_s3(bucket)
        fs = s3fs.S3FileSystem()
        summary = json.loads(fs.cat_file(f"{bucket}/out/summary.json"))
        assert summary["requests"]["done"] == ROWS and summary["requests"]["invalid_lines"] == 1
        assert summary["results_path"] == f"s3://{bucket}/out/results/"
        assert json.loads(fs.cat_file(f"{bucket}/out/job.json"))["input"] == f"s3://{bucket}/in.jsonl"
        names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/out/index", detail=False))
        assert names == [f"part-{n:05d}.index" for n in range(1, 9)]  # 30 rows in parts of 4
        # A re-run has nothing to do, and an unknown spool (another machine) knows that from the parts.
        capsys.readouterr()
        assert main(flags(bucket, stub, tmp_path / "other-spool")) == 1
        assert "nothing to run" in capsys.readouterr().err
        assert len(stub.bodies) == ROWS
        assert_exactly_once_on_s3(bucket)


def start_and_kill(bucket: str, stub: StubServer, spool: Path) -> int:
    """Run the job in a process of its own and kill -9 it once a part is committed and more rows
    are in its journal (one request at a time: a row every 50 ms, so the kill lands between two);
    returns how many rows the journal holds past the parts."""
    command = [sys.executable, "-m", "tokenmill", *flags(bucket, stub, spool, "--concurrency", "1")]
    proc = subprocess.Popen(command,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker, journal = spool / "parts.json", spool / "results.jsonl"
    deadline = time.monotonic() + 60
    while not (marker.exists() and json.loads(marker.read_text())["part"] >= 1
               and journal.read_bytes().count(b"\n") % PART_ROWS != 0):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "no part committed within 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert journal.read_bytes().count(b"\n") < ROWS, "the kill did not land mid-way"
    return journal.read_bytes()[json.loads(marker.read_text())["offset"]:].count(b"\n")


@pytest.mark.slow
def test_a_killed_job_resumes_from_its_spool_exactly_once(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spool = tmp_path / "spool"
    with StubServer(delay=0.05) as stub:
        tail = start_and_kill(bucket, stub, spool)
        answered = len((spool / "results.jsonl").read_bytes().splitlines())
        sent_before = len(stub.bodies)
        capsys.readouterr()
        assert main(flags(bucket, stub, spool, "--concurrency", "4")) == 1
        assert tail and f"committed {tail} row(s) the last run left in its journal" in capsys.readouterr().err
        assert len(stub.bodies) - sent_before == ROWS - answered  # what the journal held was not sent again
    assert_exactly_once_on_s3(bucket)


@pytest.mark.slow
def test_a_killed_job_resumes_without_its_spool_and_a_stale_spool_is_set_aside(bucket: str, tmp_path: Path) -> None:
    spool, stale = tmp_path / "spool", tmp_path / "stale-spool"
    with StubServer(delay=0.05) as stub:
        start_and_kill(bucket, stub, spool)
        shutil.copytree(spool, stale)  # this machine's spool, as it was at the kill
        shutil.rmtree(spool)  # … lost: the job goes on elsewhere from the committed parts alone
        assert main(flags(bucket, stub, spool, "--concurrency", "4")) == 1
        assert_exactly_once_on_s3(bucket)
        sent = len(stub.bodies)
        # The first machine comes back with its old journal: its tail was redone elsewhere, so it is discarded.
        assert main(flags(bucket, stub, stale)) == 1
        assert len(stub.bodies) == sent
    assert_exactly_once_on_s3(bucket)


def test_a_missing_object_and_a_missing_protocol_package_are_named(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "out")
    assert main(["run", f"s3://{bucket}/nope.jsonl", "-o", out, "--endpoint", "http://127.0.0.1:9"]) == 2
    assert f"input file 's3://{bucket}/nope.jsonl' not found" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not found"):
        storage.open_input(f"s3://{bucket}/nope.jsonl")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        assert main(["run", "gs://b/in.jsonl", "-o", out, "--endpoint", "http://127.0.0.1:9"]) == 2
        assert "pip install gcsfs" in capsys.readouterr().err
        with pytest.raises(StorageError, match="pip install gcsfs"):
            storage.open_input("gs://b/in.jsonl")


def test_an_http_input_is_read_through_fsspec(bucket: str, tmp_path: Path) -> None:
    """An input given by an http(s):// URL: a presigned object URL, read with Range requests, with a
    local output; a re-run with the URL signed anew resumes (the input is known by its content)."""
    out = tmp_path / "out"
    fs = s3fs.S3FileSystem()
    with StubServer() as stub:
        flags = ["-o", str(out), "--endpoint", stub.url, "--max-tokens", "4", "--no-progress"]
        assert main(["run", fs.sign(f"{bucket}/in.jsonl"), *flags]) == 1  # the bad line failed
        assert len(stub.bodies) == ROWS
        assert main(["run", fs.sign(f"{bucket}/in.jsonl", expiration=7200), *flags]) == 1  # signed anew
        assert len(stub.bodies) == ROWS  # nothing sent again
    ids = sorted(json.loads(line)["custom_id"] for line in (out / "results.jsonl").read_text().splitlines())
    assert ids == [f"r-{i:02d}" for i in range(ROWS)]


def test_locations() -> None:
    assert storage.location("s3://b/k.jsonl") == "s3://b/k.jsonl"  # a Path would fold the "//"
    assert storage.location("file:///data/in.jsonl") == Path("/data/in.jsonl")
    assert storage.location("in.jsonl") == Path("in.jsonl")
    assert storage.suffix("https://host/a/b.CSV?sig=1") == ".csv"
