"""End-to-end sweeps with tiny lengths: the embedded engine, and an endpoint over HTTP.

`tokenmill serve` did not exist yet when this was written, so the endpoint test runs against a
small OpenAI-style streaming stub on 127.0.0.1 that counts tokens with the real tokenizer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tokenmill import LLM
from tokenmill.bench.embedded import EmbeddedTarget
from tokenmill.bench.endpoint import EndpointTarget
from tokenmill.bench.report import to_json, write_all
from tokenmill.bench.runner import SweepConfig, run_sweep
from tokenmill.bench.workloads import Corpus, LengthSpec, Workload
from tokenmill.plan.measured import load_measured

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(smollm_weights: Any) -> EmbeddedTarget:
    llm = LLM(weights=smollm_weights, max_num_seqs=2, max_model_len=256)
    return EmbeddedTarget(llm, "smollm2-test")


def test_embedded_sweep_end_to_end(target: EmbeddedTarget, tmp_path: Path) -> None:
    wl = Workload(LengthSpec(16), LengthSpec(4))
    result = run_sweep(target, wl, SweepConfig([1, 2], runs=2, warmup=1, price_per_hour=0.1),
                       log=lambda m: None)
    assert [p.batch_size for p in result.points] == [1, 2]
    for p in result.points:
        assert p.num_failed == 0 and p.shape_mismatches == 0
        assert (p.input_len_mean, p.output_len_mean) == (16, 4)  # output length enforced
        assert p.cached_tokens == 0  # fresh prompts every run
        assert p.ttft_p50 and p.tpot_p50 and p.output_tokens_per_s > 0
        assert p.peak_kv_usage and 0 < p.peak_kv_usage <= 1 and p.preemptions == 0
    assert result.points[1].gain is not None and not result.warnings
    records = [r for run in result.runs[2] for r in run.records]
    assert all(len(r.token_times) == 4 for r in records)
    paths = write_all(result, tmp_path)
    assert all(path.stat().st_size > 0 for path in paths.values())
    measured = load_measured(paths["json"])
    assert [m.batch_size for m in measured.points] == [1, 2]


def test_shared_prefix_hits_the_cache(target: EmbeddedTarget) -> None:
    wl = Workload(LengthSpec(48), LengthSpec(2), prefix_len=32, num_prefixes=1)
    result = run_sweep(target, wl, SweepConfig([2], runs=1, num_requests=4, warmup=0), log=lambda m: None)
    assert result.points[0].cached_tokens >= 2 * 32  # the second wave reuses the prefix
    assert not any("prefix cache" in w for w in result.warnings)


def test_prompts_are_real_text_at_exact_lengths(smollm_weights: Any) -> None:
    import random

    corpus = Corpus(smollm_weights.tokenizer, seed=1)
    reqs = Workload(LengthSpec(40, "uniform", 0.5), LengthSpec(4)).make(20, corpus, random.Random(0),
                                                                         smollm_weights.tokenizer)
    assert all(len(r.prompt_token_ids) == r.input_len for r in reqs)
    assert len({r.input_len for r in reqs}) > 1
    assert len({tuple(r.prompt_token_ids[:16]) for r in reqs}) == 20  # no shared first block
    assert " the " in smollm_weights.tokenizer.decode(reqs[0].prompt_token_ids)


# ---- the endpoint target against a local streaming stub -----------------------------------
def stub_server(tokenizer: Any) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._json({"data": [{"id": "stub-model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n_in = len(tokenizer.encode(body["prompt"], add_special_tokens=False))
            n_out = body["max_tokens"] if body.get("ignore_eos") else 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(n_out):
                time.sleep(0.005)
                self._event({"choices": [{"index": 0, "text": " tok"}]})
            self._event({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out}})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, obj: dict[str, Any]) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def _json(self, obj: dict[str, Any]) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


@pytest.fixture()
def stub_url(smollm_weights: Any) -> Iterator[str]:
    yield from stub_server(smollm_weights.tokenizer)


def test_endpoint_sweep_against_stub(stub_url: str, smollm_weights: Any) -> None:
    target = EndpointTarget(stub_url, smollm_weights.tokenizer)
    assert target.model == "stub-model"
    wl = Workload(LengthSpec(16), LengthSpec(4))
    result = run_sweep(target, wl, SweepConfig([1, 2], runs=2, num_requests=4, warmup=1, price_per_hour=1.0),
                       log=lambda m: None)
    for p in result.points:
        assert p.num_failed == 0 and p.shape_mismatches == 0, result.warnings
        assert p.ttft_p50 and p.tpot_p50 and p.tpot_p50 >= 0.004
    data = to_json(result)
    assert data["points"][0]["usd_per_m_output"] > 0
    assert data["target"]["kind"] == "endpoint"


def test_endpoint_shape_check_catches_ignored_min_tokens(stub_url: str, smollm_weights: Any) -> None:
    target = EndpointTarget(stub_url, smollm_weights.tokenizer, plain_openai=True)
    result = run_sweep(target, Workload(LengthSpec(16), LengthSpec(4)), SweepConfig([2], runs=1, warmup=0),
                       log=lambda m: None)
    assert result.points[0].shape_mismatches == 2
    assert any("differ from the requested" in w for w in result.warnings)
