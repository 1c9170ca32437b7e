"""The endpoint target against a real `tokenmill serve` on a free loopback port (tiny lengths)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.serve_helpers import serving
from tokenmill import LLM
from tokenmill.bench.endpoint import EndpointTarget
from tokenmill.bench.runner import SweepConfig, run_sweep
from tokenmill.bench.workloads import LengthSpec, Workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve_v1(smollm_weights: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    llm = LLM(weights=smollm_weights, max_num_seqs=2, max_model_len=256)
    with serving(llm, tmp_path_factory.mktemp("s"), "bench-test") as running:
        yield running.v1


def test_sweep_against_tokenmill_serve(serve_v1: str, smollm_weights: Any) -> None:
    target = EndpointTarget(serve_v1, smollm_weights.tokenizer)
    assert target.model == "bench-test"
    result = run_sweep(target, Workload(LengthSpec(16), LengthSpec(4)), SweepConfig([1, 2], runs=1, warmup=1),
                       log=lambda m: None)
    for p in result.points:
        assert p.num_failed == 0, result.warnings
        assert (p.input_len_mean, p.output_len_mean, p.shape_mismatches) == (16, 4, 0), result.warnings
        assert p.cached_tokens == 0 and p.ttft_p50 and p.tpot_p50 and p.output_tokens_per_s > 0
