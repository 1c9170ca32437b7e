"""An in-process engine as a bench target, driven step by step in this process: the embedded
engine, or vLLM's through the same interface (vllm_engine/).

Batch size B sets `max_num_seqs` (the running batch) and the offered load: every request of a
run is added at once, so the engine always has B to run while any wait. A timestamp is taken
each time a request's output grows, which gives TTFT and every inter-token gap.
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.runner import RunOutcome
from tokenmill.bench.workloads import Request
from tokenmill.engine import FinishReason, InProcessModel, RequestOutput, SamplingParams


class EmbeddedTarget:
    def __init__(self, llm: InProcessModel, model_name: str, kind: str = "embedded") -> None:
        self.llm = llm
        self.engine = llm.engine
        self.label = model_name
        self.kind = kind

    @property
    def tokenizer(self) -> Any:
        return self.llm.tokenizer

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.label, "engine": self.engine.describe()}

    def close(self) -> None:
        """Free the engine before another loads (vLLM's runs in a process of its own)."""
        self.engine.close()

    def run(self, requests: list[Request], batch_size: int) -> RunOutcome:
        engine = self.engine
        engine.set_max_num_seqs(batch_size)
        before = engine.stats()
        t0 = time.monotonic()
        records: dict[str, RequestRecord] = {}
        for i, req in enumerate(requests):
            params = SamplingParams(max_tokens=req.output_len, min_tokens=req.output_len,
                                    ignore_eos=True, temperature=0.0)
            rid = engine.add_request({"prompt_token_ids": req.prompt_token_ids}, params,
                                     request_id=f"bench-{t0:.6f}-{i}")
            records[rid] = RequestRecord(rid, req.input_len, req.output_len, 0, 0, 0,
                                         time.monotonic() - t0, None, None)
        peak_kv = 0.0
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.monotonic() - t0
            peak_kv = max(peak_kv, engine.metrics().kv_usage)
            for out in outputs:
                _update(records[out.request_id], out, now)
        wall = time.monotonic() - t0
        after = engine.stats()
        extra = {"engine_prefill_tokens": after.prefill_tokens - before.prefill_tokens,
                 "engine_decode_tokens": after.decode_tokens - before.decode_tokens}
        return RunOutcome(list(records.values()), wall, peak_kv, after.num_preemptions - before.num_preemptions,
                          extra)


def _update(rec: RequestRecord, out: RequestOutput, now: float) -> None:
    """Record one step's progress; a step adds at most one token per request."""
    while len(rec.token_times) < out.num_output_tokens:
        rec.token_times.append(now)
    if rec.first_token is None and out.num_output_tokens:
        rec.first_token = now
    rec.input_tokens = out.num_prompt_tokens
    rec.output_tokens = out.num_output_tokens
    rec.cached_tokens = out.num_cached_tokens
    if out.finished:
        rec.end = now
        if out.finish_reason is FinishReason.ABORT:
            rec.error = "aborted"
