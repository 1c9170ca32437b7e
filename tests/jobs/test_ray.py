"""`tokenmill run --ray` on one small local Ray cluster (2 logical CPUs, 2 replicas).

The embedded-model jobs ship the already-loaded weights to the replicas (`EmbeddedBackend(weights=…)`
travels through Ray's object store), so a replica starts in seconds instead of re-reading the GGUF.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill import LLM, EngineConfig
from tokenmill.jobs.backends.base import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.backends.embedded import EmbeddedBackend
from tokenmill.jobs.backends.endpoint import EndpointBackend, EndpointSpec
from tokenmill.jobs.backends.http import RetryPolicy
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.errors import JobFailed
from tokenmill.jobs.input.request import BatchRequest, DocumentOptions
from tokenmill.jobs.journal.rows import encode_row, line_of
from tokenmill.jobs.runner import run_job
from tokenmill.models.loader import LoadedWeights

from .conftest import assert_exactly_once, batch_line, read_jsonl, write_jsonl
from .stub_server import StubServer

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenmill[ray]' (`make install` does)")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'tokenmill[ray]'")

from tokenmill.jobs.backends.ray import RayBackend, RayOptions, Replica, serve_batch  # noqa: E402

ENGINE = {"max_num_seqs": 4, "num_kv_blocks": 96, "max_model_len": 384}
OPTIONS = DocumentOptions(max_tokens=6, temperature=0)
SYSTEM = "Sort the customer review into positive, negative or mixed and say why in a few words."
REVIEWS = ["The kettle boils fast and looks great.", "The lid broke after a week.",
           "Works, but the cable is short.", "Best purchase this year.", "Arrived late and scratched."]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local cluster for the session: 2 logical CPUs, so the 2 replicas take every CPU (the job
    must still finish: nothing else in its pipeline needs one)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        os.environ.pop(name, None)  # the workers inherit this environment; the stubs are on 127.0.0.1
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting backends below
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def chat(custom_id: str, review: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": review}]}}


class FaultyBackend(EmbeddedBackend):
    """The embedded backend with faults on cue: the process dies (os._exit) the first time the result
    of "crash" is about to be handed over, half-way through its batch; "boom" raises like an engine
    bug, every time it reaches the engine."""

    def __init__(self, marker: str, weights: LoadedWeights, **engine: Any) -> None:
        super().__init__(EngineConfig(**engine), weights=weights)
        self.marker = marker  # a file: "crash" has killed a replica once (shared by every process here)

    def share_machine(self, share: float) -> None:
        Path(self.marker + ".share").write_text(str(share))  # what the replica was told
        super().share_machine(share)

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        def faulty() -> Iterator[BatchRequest]:
            for request in requests:
                if request.custom_id == "boom":
                    raise RuntimeError("simulated engine bug")
                yield request

        real_result = sink.result

        def result(request: BatchRequest, *args: Any, **kw: Any) -> None:
            if request.custom_id == "crash" and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os._exit(1)
            real_result(request, *args, **kw)

        sink.result = result  # type: ignore[method-assign]
        return super().run(faulty(), sink, stop)


@pytest.fixture(scope="module")
def job_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows: list[Any] = [chat(f"r{i}", text) for i, text in enumerate(REVIEWS)]
    rows[2:2] = [chat("crash", "Loud, but it cleans well."), chat("boom", "Fine.")]
    rows += [batch_line("digits", "The year is", url="/v1/completions",
                        guided_regex="[0-9]{30}"),  # constrained, and cut by max_tokens: counted
             chat("huge", "word " * 600),  # longer than the 384-token context: invalid_request
             '{"custom_id": "broken"']  # not JSON: invalid_input
    return write_jsonl(tmp_path_factory.mktemp("ray") / "in.jsonl", rows)


@pytest.fixture(scope="module")
def single(job_input: Path, smollm_weights: LoadedWeights) -> dict[str, dict[str, Any]]:
    """The same job on one machine, in this process: the reference."""
    out = job_input.parent / "single"
    llm = LLM(weights=smollm_weights, **ENGINE)
    run_job(JobConfig(input=job_input, output=out, options=OPTIONS, progress=False), EmbeddedBackend(llm=llm))
    return {r["custom_id"]: r for r in read_jsonl(out / "results.jsonl")}


@pytest.fixture(scope="module")
def on_ray(ray_cluster: None, job_input: Path, single: dict[str, Any], smollm_weights: LoadedWeights) -> Path:
    """The single-machine job's output cut back to two results and a torn third, as a stopped job
    leaves it, then resumed on Ray with 2 replicas (one Ray job covers resume, the replica killed
    mid-batch, error rows and equality: each replica start costs seconds on 2 cores)."""
    out, marker = job_input.parent / "ray", job_input.parent / "crashed"
    shutil.copytree(job_input.parent / "single", out)
    kept = [encode_row(single["r0"]), encode_row(single["r1"])]
    torn = encode_row(single["r2"])
    (out / "results.jsonl").write_bytes(b"".join(kept) + torn[: len(torn) // 2])
    (out / "errors.jsonl").write_bytes(b"")
    backend = FaultyBackend(str(marker), weights=smollm_weights, num_threads=1, **ENGINE)
    # Batches of 3: the 7 requests left that reach the replicas make 3 blocks for 2 actors.
    ray_backend = RayBackend([backend], RayOptions(replicas=2, batch_size=3, no_progress_timeout_s=300))
    outcome = run_job(JobConfig(input=job_input, output=out, options=OPTIONS, progress=False), ray_backend)
    assert outcome.status == "failed"
    return out


def texts(results: dict[str, dict[str, Any]]) -> dict[str, tuple[str, int, int]]:
    def one(row: dict[str, Any]) -> tuple[str, int, int]:
        body = row["response"]["body"]
        choice, usage = body["choices"][0], body["usage"]
        return choice.get("message", {}).get("content", choice.get("text")), usage["prompt_tokens"], \
            usage["completion_tokens"]
    return {custom_id: one(row) for custom_id, row in results.items()}


@pytest.mark.slow
def test_ray_output_equals_the_single_machine_job(on_ray: Path, single: dict[str, Any]) -> None:
    results = {r["custom_id"]: r for r in read_jsonl(on_ray / "results.jsonl")}
    assert sorted(results) == sorted(set(single) - {"boom"})  # boom: the simulated engine bug, below
    assert texts(results) == {k: v for k, v in texts(single).items() if k != "boom"}
    assert results["digits"]["response"]["body"]["object"] == "text_completion"
    assert results["r3"]["response"]["body"]["model"] == single["r3"]["response"]["body"]["model"]

    summary = json.loads((on_ray / "summary.json").read_text())
    assert summary["backend"] == "embedded" and summary["engine"]["replicas"] == 2
    this_run = [r for r in results.values() if r["custom_id"] not in ("r0", "r1")]
    assert summary["tokens"]["completion"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                                  for r in this_run)
    assert summary["engine"]["decode_tokens"] > 0 and summary["time"]["load_s"] > 0
    assert summary["throughput"]["output_tok_s"] > 0
    assert (on_ray.parent / "crashed.share").read_text() == "0.5"  # 1 of the node's 2 CPUs


@pytest.mark.slow
def test_a_replica_killed_mid_batch_still_gives_every_row_once(on_ray: Path) -> None:
    assert (on_ray.parent / "crashed").exists()  # a replica did die (os._exit) with "crash" in hand
    assert_exactly_once(on_ray, 10)
    assert "crash" in {r["custom_id"] for r in read_jsonl(on_ray / "results.jsonl")}


@pytest.mark.slow
def test_per_request_failures_are_error_rows(on_ray: Path) -> None:
    errors = {line_of(e): e for e in read_jsonl(on_ray / "errors.jsonl")}
    assert sorted(errors) == [4, 9, 10]  # boom, huge, the broken line
    boom, huge = errors[4]["error"], errors[9]["error"]
    assert errors[4]["custom_id"] == "boom" and boom["code"] == "worker_error"
    assert "simulated engine bug" in boom["message"]
    assert huge["code"] == "invalid_request" and "384" in huge["message"]
    assert errors[10]["error"]["code"] == "invalid_input"


@pytest.mark.slow
def test_resume_on_ray_skips_the_rows_already_written(on_ray: Path, single: dict[str, Any]) -> None:
    results = read_jsonl(on_ray / "results.jsonl")
    assert results[:2] == [single["r0"], single["r1"]]  # untouched; the torn third row was cut
    assert "r2" in {r["custom_id"] for r in results[2:]}  # ... and its request ran again
    summary = json.loads((on_ray / "summary.json").read_text())
    assert summary["requests"] == {"total": 10, "done": 7, "failed": 3, "not_done": 0, "invalid_lines": 1,
                                   "retryable": 1, "done_this_run": 5, "failed_this_run": 2,
                                   "structured": 1, "structured_cut": 1,  # "digits", answered on a replica
                                   "max_tokens_defaulted": 9, "default_max_tokens": 6}  # OPTIONS filled them all


class Gauge:
    """Requests in flight across several stub servers."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight = self.max_inflight = 0


class GaugedStub(StubServer):
    def __init__(self, gauge: Gauge, **kw: Any) -> None:
        super().__init__(**kw)
        self.gauge = gauge

    def admit(self, key: str, body: dict[str, Any], headers: dict[str, str]) -> str:
        with self.gauge.lock:
            self.gauge.inflight += 1
            self.gauge.max_inflight = max(self.gauge.max_inflight, self.gauge.inflight)
        return super().admit(key, body, headers)

    def done(self) -> None:
        with self.gauge.lock:
            self.gauge.inflight -= 1
        super().done()


RETRY = RetryPolicy(max_attempts=2, base_delay=0.01)


@pytest.mark.slow
def test_endpoints_on_ray_keep_the_global_bound_and_stop(ray_cluster: None, tmp_path: Path) -> None:
    """What `--ray --replicas 2 --concurrency 4 --endpoint URL` builds (see jobs/cli.py), stopped like a
    Ctrl-C once some rows are on disk, then resumed (without Ray: the files are the same job's)."""
    n = 24
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line(f"q{i}", f"doc {i}") for i in range(n)])
    config = JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=4), progress=False)
    gauge, stop = Gauge(), StopFlag()

    def stop_after_first_rows() -> None:
        while len(read_jsonl(tmp_path / "out/results.jsonl")) < 4:
            time.sleep(0.05)
        stop.request()

    with GaugedStub(gauge, delay=0.3) as stub:
        threading.Thread(target=stop_after_first_rows, daemon=True).start()
        # 4 in all ÷ 2 replicas
        share = EndpointBackend(EndpointSpec(stub.url, concurrency=2, timeout_s=5, retry=RETRY))
        options = RayOptions(replicas=2, batch_size=4, no_progress_timeout_s=60)
        assert run_job(config, RayBackend([share], options), stop=stop).status == "interrupted"
        first = read_jsonl(tmp_path / "out/results.jsonl")
        assert 4 <= len(first) < n and len(first) % 4 == 0  # whole batches only
        summary = json.loads((tmp_path / "out/summary.json").read_text())
        assert summary["interrupted"] and summary["engine"]["replicas"] == 2
        assert 2 <= gauge.max_inflight <= 4  # --concurrency 4 over 2 replicas: never more in flight
        alone = EndpointBackend(EndpointSpec(stub.url, concurrency=4, timeout_s=5, retry=RETRY))
        assert run_job(config, alone).status == "done"
    assert_exactly_once(tmp_path / "out", n)
    assert read_jsonl(tmp_path / "out/results.jsonl")[: len(first)] == first


def test_a_replica_spreads_batches_over_endpoints_and_isolates_a_failure() -> None:
    """The actor's code, called directly (no cluster): each batch goes to one of the endpoints, and a
    backend that raises on one request costs that request only."""
    with StubServer() as a, StubServer() as b:
        replica = Replica([EndpointBackend(EndpointSpec(s.url, concurrency=2, timeout_s=5, retry=RETRY))
                           for s in (a, b)])
        for k in range(8):
            ids = [f"b{k}-{i}" for i in range(3)]
            out = replica({"custom_id": ids, "line": [1, 2, 3], "url": ["/v1/completions"] * 3,
                           "body": [json.dumps({"prompt": i, "max_tokens": 2}) for i in ids],
                           "metadata": ["null"] * 3})
            assert sorted(out["custom_id"]) == ids and out["stats"][0] and out["stats"][1:] == ["", ""]
        assert a.attempts and b.attempts and len(a.attempts) + len(b.attempts) == 24
        assert not {k.split("-")[0] for k in a.attempts} & {k.split("-")[0] for k in b.attempts}  # whole batches

        requests = [BatchRequest(i, f"r{i}", "/v1/completions", {"prompt": f"p{i}"}) for i in range(3)]
        rows, _ = serve_batch(RaisesOn("r1", a.url), requests)
    assert {r["custom_id"]: (r["error"] or {}).get("code") for r in rows} == {
        "r0": None, "r1": "worker_error", "r2": None}


class RaisesOn(EndpointBackend):
    """An endpoint backend with a bug that raises whenever one request's turn comes."""

    def __init__(self, bad: str, url: str) -> None:
        super().__init__(EndpointSpec(url, concurrency=1, timeout_s=5, retry=RETRY))
        self.bad = bad

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        def buggy() -> Iterator[BatchRequest]:
            for request in requests:
                if request.custom_id == self.bad:
                    raise KeyError(self.bad)
                yield request

        return super().run(buggy(), sink, stop)


def test_a_cluster_that_cannot_hold_the_replicas_fails_loudly(
    ray_cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "hello")])
    config = JobConfig(input=path, output=tmp_path / "out", options=DocumentOptions(max_tokens=4), progress=False)
    unused = EndpointBackend(EndpointSpec("http://127.0.0.1:9", concurrency=1))  # never reached: no replica can start
    options = RayOptions(replicas=2, cpus_per_replica=3, batch_size=8, no_progress_timeout_s=2)
    with pytest.raises(JobFailed, match="made no progress for 2 s"):
        run_job(config, RayBackend([unused], options))
    assert "the Ray cluster has 2 CPU(s) now, the 2 replica(s) need 6" in capsys.readouterr().err
    assert read_jsonl(tmp_path / "out/results.jsonl") == []  # claimed, nothing written: a re-run resumes


def test_the_single_machine_path_never_imports_ray(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "hello")])
    code = ("import sys; from tokenmill.cli import main\n"
            "try:\n    main(['run', sys.argv[1], '-o', sys.argv[2], '--endpoint', 'http://127.0.0.1:9', "
            "'--max-attempts', '1', '--no-progress'])\nexcept SystemExit:\n    pass\n"
            "assert 'ray' not in sys.modules, 'imported ray'\n"
            "import tokenmill.jobs.backends.embedded, tokenmill.jobs.cli, tokenmill.jobs.runner\n"
            "assert 'ray' not in sys.modules, 'imported ray'\n")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert read_jsonl(tmp_path / "out/errors.jsonl")[0]["error"]["code"] == "connection_error"  # it did run


def test_cli_refuses_ray_options_without_ray_and_a_concurrency_below_the_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenmill.cli import main

    path = write_jsonl(tmp_path / "in.jsonl", [batch_line("a", "hello")])
    base = ["run", str(path), "-o", str(tmp_path / "out"), "--no-progress"]
    assert main([*base, "--replicas", "2"]) == 2
    assert main([*base, "--ray", "--replicas", "4", "--concurrency", "2", "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "--replicas need --ray" in err
    assert "--concurrency 2 is below --replicas 4" in err
    assert not (tmp_path / "out").exists()  # refused before claiming anything


def test_replicas_on_one_machine_split_the_kv_memory_budget() -> None:
    shared = EmbeddedBackend(EngineConfig())
    shared.share_machine(0.25)  # e.g. 1 of a node's 4 CPUs
    assert shared.spec.kv_cache_memory_fraction == pytest.approx(0.1)  # 0.4 × 0.25
    fixed = EmbeddedBackend(EngineConfig(num_kv_blocks=96))
    fixed.share_machine(0.25)  # an explicit KV size is the user's: left alone
    assert fixed.spec == EngineConfig(num_kv_blocks=96)
