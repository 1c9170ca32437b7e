"""vLLM's engine processes die with the tokenmill process that started them (vllm_engine/lifeline.py):
a kill -9 of the tokenmill pid alone leaves no engine process behind.

The first test holds the mechanism to it without vLLM (a child that watches its parent, and a
grandchild below it), so `make test` runs it; the second kills a real `tokenmill run --engine vllm`
mid-job (`make test-vllm`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie (a killed orphan waits there for PID 1 to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_left(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# The "engine": watches its parent (as vLLM's EngineCore does once tied), and starts a worker below it.
ENGINE = textwrap.dedent("""
    import subprocess, sys, time
    from tokenmill.vllm_engine.lifeline import watch_parent
    watch_parent(0.1)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(worker.pid, flush=True)
    time.sleep(120)
""")
# The "tokenmill process": starts the engine, says both pids, and waits to be killed.
TOKENMILL = textwrap.dedent("""
    import subprocess, sys, time
    engine = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    print(engine.pid, engine.stdout.readline().strip(), flush=True)
    time.sleep(120)
""")


def test_an_engine_that_watches_its_parent_dies_with_it_and_takes_its_workers() -> None:
    parent = subprocess.Popen([sys.executable, "-c", TOKENMILL, ENGINE], stdout=subprocess.PIPE, text=True, env=ENV)
    engine, worker = (int(p) for p in parent.stdout.readline().split())  # type: ignore[union-attr]
    try:
        time.sleep(0.5)  # several polls: a live parent is not taken for a dead one
        assert alive(engine) and alive(worker)
        parent.kill()  # kill -9 of the "tokenmill" pid alone
        parent.wait()
        assert wait_until_gone([engine, worker], timeout=3) == []
    finally:
        kill_left([engine, worker])
        parent.kill()


# ---- the real thing: `tokenmill run --engine vllm`, kill -9 mid-job ---------------------------------------
def descendants(pid: int) -> list[int]:
    from tokenmill.vllm_engine.lifeline import descendants as below

    return below(pid)


@pytest.mark.slow
def test_kill_9_of_tokenmill_alone_leaves_no_vllm_process(tmp_path: Path, gguf_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this in .venv-vllm")
    from tokenmill.models.export import hf_folder_for

    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "m", "prompt": f"Count from {i}:", "max_tokens": 64, "ignore_eos": True}}
            for i in range(200)]
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = tmp_path / "out" / "results.jsonl"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(job), "-o", str(tmp_path / "out"), "--engine", "vllm",
           "--model", hf_folder_for(str(gguf_path)), "--max-num-seqs", "2", "--no-progress", "--dtype", "float32",
           "--max-model-len", "256", "--engine-arg", "enforce_eager=true"]
    # A session of its own, as a scheduler's job has: the kill below is of the one pid, not the group.
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, env=ENV)
    engine_processes: list[int] = []
    try:
        deadline = time.monotonic() + 600  # vLLM starts in about a minute on CPU
        while not (results.exists() and results.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no result within 600 s"
            time.sleep(0.1)
        engine_processes = descendants(proc.pid)
        assert engine_processes, "vLLM started no engine process"
        proc.kill()  # SIGKILL to tokenmill's own pid, as the OOM killer sends it
        proc.wait(timeout=30)
        left = wait_until_gone(engine_processes, timeout=10)
        assert left == [], f"still running after tokenmill was killed: {left}"
    finally:
        kill_left(engine_processes)
        proc.kill()
