"""The endpoint target against a real `tokenmill serve` on a free loopback port (tiny lengths)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill import LLM
from tokenmill.bench.endpoint import EndpointTarget
from tokenmill.bench.runner import SweepConfig, run_sweep
from tokenmill.bench.workloads import LengthSpec, Workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve_v1(smollm_weights: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    uvicorn = pytest.importorskip("uvicorn")
    app_module = pytest.importorskip("tokenmill.serve.app")
    llm = LLM(weights=smollm_weights, max_num_seqs=2, max_model_len=256)
    state = app_module.ServeState(llm, model_name="bench-test", state_dir=Path(tmp_path_factory.mktemp("s")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app_module.create_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_sweep_against_tokenmill_serve(serve_v1: str, smollm_weights: Any) -> None:
    target = EndpointTarget(serve_v1, smollm_weights.tokenizer)
    assert target.model == "bench-test"
    result = run_sweep(target, Workload(LengthSpec(16), LengthSpec(4)), SweepConfig([1, 2], runs=1, warmup=1),
                       log=lambda m: None)
    for p in result.points:
        assert p.num_failed == 0, result.warnings
        assert (p.input_len_mean, p.output_len_mean, p.shape_mismatches) == (16, 4, 0), result.warnings
        assert p.cached_tokens == 0 and p.ttft_p50 and p.tpot_p50 and p.output_tokens_per_s > 0
