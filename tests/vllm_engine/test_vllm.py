"""--engine vllm on vLLM's CPU build (`make test-vllm`, in .venv-vllm): greedy output against the
transformers reference as the embedded engine is held to, a killed job resumed exactly once, and
the side-by-side benchmark. `make test` skips this file (vLLM is not installed there)."""

from __future__ import annotations

import dataclasses
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
from tokenmill.jobs.journal.rows import answer_of
from tokenmill.models.export import hf_folder_for

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
pytestmark = pytest.mark.slow

from tokenmill.cli import build_parser  # noqa: E402
from tokenmill.engines import load_engine  # noqa: E402
from tokenmill.vllm_engine import engine_spec  # noqa: E402
from tokenmill.vllm_engine.engine import VllmLLM  # noqa: E402  (after the skip: it is only useful with vLLM)

# Both engines in fp32 on the same weights, prefix caching off on both, as the comparison asks:
# tokenmill's own flags, which reach vLLM as they reach the embedded engine.
# enforce_eager: vLLM skips its torch.compile warm-up (minutes here), which these tests do not need.
VLLM_FLAGS = ["--dtype", "float32", "--max-model-len", "1024", "--no-enable-prefix-caching",
              "--engine-arg", "enforce_eager=true"]
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
           "List three primary colours:", "The quick brown fox", "In 1969, the first person to walk on the moon was"]


@pytest.fixture(scope="module")
def folder(gguf_path: Path) -> str:
    return hf_folder_for(str(gguf_path))  # the embedded SmolLM2, exported once to a folder vLLM reads


@pytest.fixture(scope="module")
def vllm_llm(folder: str) -> VllmLLM:
    """Built from `tokenmill run`'s flags, as a job builds it."""
    args = build_parser().parse_args(["run", "in.jsonl", "-o", "out", "--engine", "vllm", "--model", folder,
                                      "--max-num-seqs", "4", *VLLM_FLAGS])
    llm = load_engine(engine_spec(args))
    assert isinstance(llm, VllmLLM)
    yield llm
    llm.engine.close()


def test_the_shared_flags_reach_vllms_engine(vllm_llm: VllmLLM) -> None:
    """--dtype float32 (the embedded engine's default too), --max-model-len, --max-num-seqs and
    --no-enable-prefix-caching as vLLM's own engine configuration holds them."""
    config = vllm_llm.engine._engine.vllm_config
    assert config.model_config.dtype == torch.float32 and config.model_config.max_model_len == 1024
    assert config.scheduler_config.max_num_seqs == 4 and not config.cache_config.enable_prefix_caching
    assert vllm_llm.engine.max_num_seqs == 4 and vllm_llm.engine.describe()["vllm_dtype"] == "float32"


def test_abort_gives_the_requests_last_output(vllm_llm: VllmLLM) -> None:
    engine = vllm_llm.engine
    engine.add_request("Once upon a time", SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                       request_id="long")
    engine.add_request("Hello", GREEDY, request_id="queued")
    while not any(o.num_output_tokens for o in engine.step() if o.request_id == "long"):
        pass
    out = engine.abort_request("long")
    assert out is not None and out.finish_reason == "abort" and out.finished and 0 < out.num_output_tokens < 64
    queued = engine.abort_request("queued")
    assert queued is not None and queued.finish_reason == "abort"
    assert engine.abort_request("long") is None and not engine.has_unfinished_requests()


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
    before = vllm_llm.engine.stats()
    got_vllm = _run(vllm_llm.engine, prompts)
    got_embedded = _run(embedded.engine, prompts)
    same = 0
    for i, ids in enumerate(prompts):
        ref = reference(ids, MAX_NEW)
        assert_matches_reference(got_vllm[f"p{i}"], ref, f"vllm prompt {i}")
        assert_matches_reference(got_embedded[f"p{i}"], ref, f"embedded prompt {i}")
        same += got_vllm[f"p{i}"] == got_embedded[f"p{i}"]
    print(f"vLLM and the embedded engine gave identical tokens for {same} of {len(prompts)} prompts")
    after = vllm_llm.engine.stats()
    assert after.prefill_tokens - before.prefill_tokens == sum(map(len, prompts))
    assert after.decode_tokens - before.decode_tokens == len(prompts) * (MAX_NEW - 1)


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


def test_logprobs_equal_transformers_through_vllm(vllm_llm: VllmLLM, folder: str) -> None:
    """SamplingParams.logprobs reaches vLLM and its per-token dicts come back as TokenLogprobs: the
    sampled token's logprob and the top 3 in order, as transformers' log_softmax at each step
    (teacher-forced on vLLM's own tokens); a request that does not ask gets none."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = vllm_llm.engine
    ids = list(vllm_llm.tokenizer.encode(PROMPTS[0]))
    engine.add_request({"prompt_token_ids": ids}, dataclasses.replace(GREEDY, logprobs=3), request_id="lp")
    engine.add_request({"prompt_token_ids": ids}, GREEDY, request_id="plain")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = done["lp"]
    assert done["plain"].logprobs is None
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == MAX_NEW
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
    expected = logits.float().log_softmax(-1)
    worst = 0.0
    for step, (token, found) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert found.token_id == token
        values = expected[step].topk(3).values.tolist()
        diffs = [abs(found.logprob - float(expected[step, token]))]
        diffs += [abs(v - w) for (_, v), w in zip(found.top, values, strict=True)]
        worst = max(worst, *diffs)
    print(f"vLLM's logprobs are within {worst:.2e} of transformers'")
    assert worst <= 1e-3  # fp32 on both: ~4e-5 seen


def _job_command(tmp_path: Path, folder: str) -> tuple[list[str], Path]:
    rows = [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "m", "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                      "max_tokens": 12, "temperature": 0}} for i in range(30)]
    path = tmp_path / "job.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--engine", "vllm",
           "--model", folder, "--max-num-seqs", "4", "--no-progress", *VLLM_FLAGS]
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
           "--out", str(out), *VLLM_FLAGS]
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
    vllm_flags = " ".join(VLLM_FLAGS)
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


def test_serve_engine_vllm_answers_the_openai_client(tmp_path: Path, folder: str) -> None:
    """`tokenmill serve --engine vllm`: chat and completions (streamed too) through the OpenAI
    client, the usage counted, and a Batch API job run on the same engine."""
    import socket

    import httpx
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--engine", "vllm", "--model", folder,
           "--served-model-name", "m", "--port", str(port), "--state-dir", str(tmp_path / "state"),
           "--log-level", "warning", *VLLM_FLAGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # vLLM starts in ~1 minute here
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the server did not come up within 600 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        exact = {"ignore_eos": True, "min_tokens": 6}
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=6, temperature=0, extra_body=exact)
        assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 6
        whole = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6,
                                          temperature=0, extra_body=exact)
        streamed = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6,
                                             temperature=0, extra_body=exact, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == whole.choices[0].text
        assert client.models.list().data[0].id == "m"

        lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "messages": [{"role": "user", "content": f"Count to {i}."}],
                           "max_tokens": 4, "temperature": 0, "ignore_eos": True}} for i in range(3)]
        upload = client.files.create(file=("in.jsonl", "".join(json.dumps(r) + "\n" for r in lines).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline + 300, batch.status
            time.sleep(0.5)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed" and batch.request_counts is not None
        assert batch.request_counts.completed == 3 and batch.output_file_id is not None
        rows = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in rows) == ["b0", "b1", "b2"]
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in rows)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
