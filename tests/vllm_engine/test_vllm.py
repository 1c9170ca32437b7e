"""--engine vllm on vLLM's CPU build (`make test-vllm`, in .venv-vllm): greedy output against the
transformers reference as the embedded engine is held to, a killed job resumed exactly once, and
the side-by-side benchmark. `make test` skips this file (vLLM is not installed there)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.jobs.conftest import assert_exactly_once, read_jsonl
from tests.reference import ReferenceCache, assert_matches_reference
from tokenmill import LLM, SamplingParams
from tokenmill.engine import StructuredOutputsParams
from tokenmill.jobs.output import answer_of
from tokenmill.models.export import hf_folder_for

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
pytestmark = pytest.mark.slow

from tokenmill.vllm_engine import VllmLLM  # noqa: E402  (after the skip: it is only useful with vLLM)

# Both engines in fp32 on the same weights, prefix caching off on both, as the comparison asks.
# enforce_eager: vLLM skips its torch.compile warm-up (minutes here), which these tests do not need.
VLLM_ARGS = {"dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": False, "enforce_eager": True}
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three primary colours:", "The quick brown fox", "In 1969, the first person to walk on the moon was"]


@pytest.fixture(scope="module")
def folder(gguf_path: Path) -> str:
    return hf_folder_for(str(gguf_path))  # the embedded SmolLM2, exported once to a folder vLLM reads


@pytest.fixture(scope="module")
def vllm_llm(folder: str) -> VllmLLM:
    llm = VllmLLM(VLLM_ARGS, model=folder, max_num_seqs=4)
    yield llm
    llm.engine.close()


def _run(engine, prompts: list[list[int]]) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    for i, ids in enumerate(prompts):
        engine.add_request({"prompt_token_ids": ids}, GREEDY, request_id=f"p{i}")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def test_greedy_output_matches_the_reference_as_the_embedded_engine_does(vllm_llm: VllmLLM, folder: str) -> None:
    """Six prompts, more than max_num_seqs (4): the adapter's queue feeds vLLM as requests finish."""
    from transformers import AutoModelForCausalLM

    reference = ReferenceCache(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    embedded = LLM(folder, max_num_seqs=4, max_model_len=1024, enable_prefix_caching=False)
    prompts = [list(embedded.tokenizer.encode(p)) for p in PROMPTS]
    got_vllm = _run(vllm_llm.engine, prompts)
    got_embedded = _run(embedded.engine, prompts)
    same = 0
    for i, ids in enumerate(prompts):
        ref = reference(ids, MAX_NEW)
        assert_matches_reference(got_vllm[f"p{i}"], ref, f"vllm prompt {i}")
        assert_matches_reference(got_embedded[f"p{i}"], ref, f"embedded prompt {i}")
        same += got_vllm[f"p{i}"] == got_embedded[f"p{i}"]
    print(f"vLLM and the embedded engine gave identical tokens for {same} of {len(prompts)} prompts")
    stats = vllm_llm.engine.stats()
    assert stats.prefill_tokens == sum(map(len, prompts)) and stats.decode_tokens == len(prompts) * (MAX_NEW - 1)


def test_refusals_name_the_reason_and_the_other_requests_run(vllm_llm: VllmLLM) -> None:
    """Too long for the context: refused when added, as the embedded engine does. A structured
    output vLLM cannot compile: refused when submitted, as that request's error output."""
    engine = vllm_llm.engine
    with pytest.raises(ValueError, match="context is 1,024 tokens"):
        engine.add_request({"prompt_token_ids": [1] * 1024}, GREEDY)
    bad_regex = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(regex="(("))
    engine.add_request("Hello", bad_regex, request_id="bad")
    engine.add_request("Hello", SamplingParams(max_tokens=4, temperature=0), request_id="ok")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["bad"].finish_reason == "error" and done["bad"].error
    assert done["ok"].finish_reason == "length" and done["ok"].num_output_tokens == 4


def test_structured_outputs_reach_vllm(vllm_llm: VllmLLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["positive", "negative"]))
    engine = vllm_llm.engine
    engine.add_request("The review 'I love it' is", params, request_id="label")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["label"].text in ("positive", "negative")


def _job_command(tmp_path: Path, folder: str) -> tuple[list[str], Path]:
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                      "max_tokens": 12, "temperature": 0}} for i in range(30)]
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--engine", "vllm",
           "--model", folder, "--max-num-seqs", "4", "--no-progress",
           *[f"--engine-arg={k}={json.dumps(v)}" for k, v in VLLM_ARGS.items()]]
    return cmd, out


def test_kill_9_mid_job_then_rerun_gives_every_row_exactly_once(tmp_path: Path, folder: str) -> None:
    cmd, out = _job_command(tmp_path, folder)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    results = out / "results.jsonl"
    deadline = time.monotonic() + 600  # vLLM starts in ~1 minute here (it compiles)
    while not (results.exists() and results.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "no result within 600 s"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # vLLM's engine process too
    proc.wait(timeout=60)
    done_before = len(read_jsonl(results))
    assert 3 <= done_before < 30, "the kill did not land mid-way"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: {done_before} done" in rerun.stderr
    assert_exactly_once(out, 30)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["requests"]["done_this_run"] == 30 - done_before
    assert summary["engine"]["prefill_tokens"] > 0 and summary["engine"]["decode_tokens"] > 0


def test_bench_measures_both_engines_side_by_side(tmp_path: Path, folder: str) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "--engine", "embedded,vllm", "--model", folder,
           "--batch-sizes", "1,4", "--input-len", "32", "--output-len", "8", "--runs", "1", "--warmup", "1",
           "--max-model-len", "1024", "--no-enable-prefix-caching", "--out", str(out),
           "--engine-arg", "dtype=float32", "--engine-arg", "enforce_eager=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for engine in ("embedded", "vllm"):
        data = json.loads((out / engine / "bench.json").read_text())
        assert data["target"]["kind"] == engine and [p["batch_size"] for p in data["points"]] == [1, 4]
        assert all(p["output_tokens"] == p["num_requests"] * 8 for p in data["points"])
    table = (out / "compare.md").read_text().split("## Side by side")[1]
    assert "ratio vs" in table and table.count("×") == 2


def test_choose_runs_a_vllm_candidate_beside_an_embedded_one(tmp_path: Path, folder: str) -> None:
    """The same model as a choice-constrained candidate on each engine: same sample, same scorer,
    both with rates, projection and the planner's ceiling; greedy and constrained, so the same labels."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    out = tmp_path / "choose"
    vllm_flags = " ".join(f"--engine-arg {k}={json.dumps(v)}" for k, v in VLLM_ARGS.items())
    cmd = [sys.executable, "-m", "tokenmill", "choose", str(examples / "reviews.jsonl"),
           "--expected", str(examples / "reviews.labels.jsonl"), "-o", str(out), "--no-progress",
           "--scorer", "label", "--min-quality", "0.3", "--sample", "6", "--price-per-hour", "0.1",
           "--hardware", "h100-sxm",
           "--flags", f"--model {folder} --temperature 0 --max-num-seqs 6 --choice positive,negative,mixed",
           "--candidate", "embedded=--no-enable-prefix-caching",
           "--candidate", f"vllm=--engine vllm {vllm_flags}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((out / "report.json").read_text())
    by_name = {c["name"]: c for c in data["candidates"]}
    for name in ("embedded", "vllm"):
        c = by_name[name]
        assert c["status"] == "done" and c["backend"] == name and c["answered"] == 6
        assert c["output_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["projected"]["rows"] == 240
        assert c["ceiling"]["hardware"] == "H100-SXM"
    answers = {name: sorted((r["custom_id"], answer_of(r["response"]["body"]))
                            for r in read_jsonl(out / "candidates" / name / "results.jsonl"))
               for name in ("embedded", "vllm")}
    assert answers["embedded"] == answers["vllm"]
    assert by_name["embedded"]["quality"]["mean"] == by_name["vllm"]["quality"]["mean"]
