"""`tokenmill serve` with an embedding model, driven by the `openai` client: /v1/embeddings live and
through the Batch API gives the vectors `Embedder` gives; generation routes there, and embeddings
on a generation server, are 400s saying which model does what."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests import serve_helpers
from tests.jobs.conftest import kill_9_after
from tests.serve.conftest import MODEL, Running
from tests.serve.test_batches import jsonl, wait_for
from tokenmill.embed.embedder import Embedder
from tokenmill.jobs.backends import BatchApiSpec, EndpointSpec, build_backend
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.input.request import DocumentOptions
from tokenmill.jobs.runner import run_job
from tokenmill.openai_compat import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL

EMBEDDING_MODEL = "minilm-test"
TEXTS = ["The cat sat on the mat.", "A dog barked at the mailman all morning long.", "Paris is in France."]
LONG_TEXT = "tokens " * 400  # over the model's 256


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture(scope="module")
def embedding_server(embedder: Embedder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    with serve_helpers.serving(embedder, tmp_path_factory.mktemp("embed-state"), EMBEDDING_MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(embedding_server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedding_server.v1, api_key="unused", max_retries=0)


def vectors(response) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == want.shape and cosines.min() > 0.99999, cosines


def test_texts_embed_as_the_embedder_embeds_them(client: openai.OpenAI, embedder: Embedder) -> None:
    out = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == EMBEDDING_MODEL and [d.index for d in out.data] == [0, 1, 2]
    assert_same(vectors(out), embedder.embed(TEXTS))
    tokens = sum(map(len, embedder.tokenize(TEXTS)))
    assert out.usage.prompt_tokens == out.usage.total_tokens == tokens
    one = client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[0], encoding_format="float")
    assert_same(vectors(one), embedder.embed(TEXTS[:1]))


def test_base64_is_the_float32_bytes_of_the_same_vectors(embedding_server: Running) -> None:
    def embed(encoding_format: str) -> list:
        body = {"model": EMBEDDING_MODEL, "input": TEXTS, "encoding_format": encoding_format}
        return [d["embedding"] for d in httpx.post(f"{embedding_server.v1}/embeddings", json=body).json()["data"]]

    decoded = np.array([np.frombuffer(base64.b64decode(text), dtype="<f4") for text in embed("base64")])
    assert np.array_equal(decoded, np.array(embed("float"), dtype=np.float32))


def test_token_ids_embed_as_their_text(client: openai.OpenAI, embedder: Embedder) -> None:
    ids = embedder.tokenize(TEXTS)
    listed = client.embeddings.create(model=EMBEDDING_MODEL, input=ids, encoding_format="float")
    assert_same(vectors(listed), embedder.embed(TEXTS))
    one = client.embeddings.create(model=EMBEDDING_MODEL, input=ids[1], encoding_format="float")
    assert_same(vectors(one), embedder.embed(TEXTS[1:2]))
    assert one.usage.prompt_tokens == len(ids[1])


def test_concurrent_requests_each_get_their_own_vectors(embedding_server: Running, embedder: Embedder) -> None:
    texts = [f"Sentence number {i} is about {'cats' if i % 2 else 'the weather'}." for i in range(12)]

    async def all_at_once() -> list:
        async with openai.AsyncOpenAI(base_url=embedding_server.v1, api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(aclient.embeddings.create(model=EMBEDDING_MODEL, input=[t, t.upper()],
                                                                    encoding_format="float") for t in texts))

    for text, out in zip(texts, asyncio.run(all_at_once()), strict=True):
        assert_same(vectors(out), embedder.embed([text, text.upper()]))


def test_a_too_long_input_is_refused_naming_the_limit_unless_truncated(client: openai.OpenAI,
                                                                      embedder: Embedder) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=EMBEDDING_MODEL, input=[TEXTS[0], LONG_TEXT])
    error = refused.value.body
    assert error["param"] == "input" and "body.input[1]" in error["message"]
    assert f"limit of {embedder.max_model_len}" in error["message"]
    cut = client.embeddings.create(model=EMBEDDING_MODEL, input=[TEXTS[0], LONG_TEXT], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": -1})
    assert_same(vectors(cut), embedder.embed([TEXTS[0], LONG_TEXT], truncate=-1))


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 12}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({}, "input"),
])
def test_bad_bodies_are_400s_naming_the_field(embedding_server: Running, body: dict, param: str) -> None:
    response = httpx.post(f"{embedding_server.v1}/embeddings", json={"model": EMBEDDING_MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["type"] == "invalid_request_error"


def test_another_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def test_generation_routes_on_an_embedding_server_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=f"embedding model: this server answers {EMBEDDINGS_URL}"):
        client.chat.completions.create(model=EMBEDDING_MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=f"not {COMPLETIONS_URL}"):
        client.completions.create(model=EMBEDDING_MODEL, prompt="hi")


def test_models_say_what_the_model_is_for(client: openai.OpenAI, embedder: Embedder) -> None:
    (model,) = client.models.list().data
    assert model.id == EMBEDDING_MODEL and model.owned_by == "tokenmill"
    assert model.model_extra == {"task": "embed", "max_model_len": embedder.max_model_len,
                                 "dimensions": embedder.dimensions}


def test_metrics_count_embedding_requests_inputs_and_tokens(embedding_server: Running, client: openai.OpenAI,
                                                            embedder: Embedder) -> None:
    before = serve_helpers.scrape(embedding_server)
    client.embeddings.create(model=EMBEDDING_MODEL, input=TEXTS[:2])
    after = serve_helpers.scrape(embedding_server)
    tokens = sum(map(len, embedder.tokenize(TEXTS[:2])))
    model = {"model_name": EMBEDDING_MODEL}

    def sample(name: str, **labels: str) -> tuple[str, frozenset]:
        return name, frozenset(labels.items())

    for key, grew in [(sample("tokenmill_embedding_inputs_total"), 2),
                      (sample("tokenmill_embedding_tokens_total"), tokens),
                      (sample("tokenmill_prompt_tokens_total"), tokens),
                      (sample("vllm:prompt_tokens_total", **model), tokens),
                      (sample("vllm:request_success_total", finished_reason="stop", **model), 1),
                      (sample("vllm:e2e_request_latency_seconds_count", **model), 1)]:
        assert after[key] - before.get(key, 0.0) == grew, key
    seconds = sample("tokenmill_embedding_forward_seconds_total")
    assert after[seconds] > before[seconds]


def batch_line(custom_id: str, body: dict, url: str = EMBEDDINGS_URL) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode() + b"\n"


def test_an_embeddings_batch_round_trip(client: openai.OpenAI, embedder: Embedder) -> None:
    lines = [batch_line("one", {"model": EMBEDDING_MODEL, "input": TEXTS[0], "encoding_format": "base64"}),
             batch_line("many", {"model": EMBEDDING_MODEL, "input": TEXTS}),
             batch_line("long", {"input": LONG_TEXT}),  # no model: the served one; too long: an error row
             batch_line("chat", {"model": EMBEDDING_MODEL, "messages": [{"role": "user", "content": "hi"}]}, CHAT_URL)]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(b"".join(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=EMBEDDINGS_URL, completion_window="24h")
    done = wait_for(client, batch.id, lambda b: b.status not in ("validating", "in_progress", "finalizing"))
    assert done.status == "completed" and done.model == EMBEDDING_MODEL, done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 2, 2)
    results = {row["custom_id"]: row["response"]["body"] for row in jsonl(client, done.output_file_id)}
    errors = {row["custom_id"]: row["error"]["message"] for row in jsonl(client, done.error_file_id)}
    assert results.keys() == {"one", "many"} and errors.keys() == {"long", "chat"}
    assert_same(np.array([d["embedding"] for d in results["many"]["data"]], dtype=np.float32), embedder.embed(TEXTS))
    one = np.frombuffer(base64.b64decode(results["one"]["data"][0]["embedding"]), dtype="<f4")
    assert_same(one[None], embedder.embed(TEXTS[:1]))
    assert results["many"]["model"] == EMBEDDING_MODEL
    assert f"limit of {embedder.max_model_len}" in errors["long"] and EMBEDDINGS_URL in errors["chat"]
    assert done.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in results.values())


def test_an_embedding_server_refuses_generation_batches(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_line("a", {"prompt": "x"}, COMPLETIONS_URL))),
                                   purpose="batch")
    with pytest.raises(openai.BadRequestError, match="embedding model") as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint=COMPLETIONS_URL, completion_window="24h")
    assert refused.value.body["param"] == "endpoint"


# ---- tokenmill run through the server ----------------------------------------------------------
def embedding_rows(count: int) -> list[str]:
    return [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": EMBEDDINGS_URL,
                        "body": {"input": f"document {i} " * (1 + i % 30)}}) for i in range(count)]


@pytest.mark.parametrize("batch_api", [False, True])
def test_a_job_runs_through_the_endpoint_and_its_batch_api(embedding_server: Running, embedder: Embedder,
                                                           tmp_path: Path, batch_api: bool) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(embedding_rows(40)) + "\n")
    spec = (BatchApiSpec(embedding_server.v1, EMBEDDING_MODEL, poll_s=0.1) if batch_api
            else EndpointSpec(embedding_server.v1, EMBEDDING_MODEL))
    outcome = run_job(JobConfig(input=path, output=tmp_path / "out", progress=False,
                                options=DocumentOptions(model=EMBEDDING_MODEL)), build_backend(spec))
    assert outcome.status == "done" and outcome.requests.done == 40 and outcome.tokens.vectors == 40
    rows = {json.loads(line)["custom_id"]: json.loads(line) for line in (tmp_path / "out" / "results.jsonl").open()}
    texts = [json.loads(line)["body"]["input"] for line in path.read_text().splitlines()]
    got = np.array([rows[f"r{i}"]["response"]["body"]["data"][0]["embedding"] for i in range(40)], dtype=np.float32)
    assert_same(got, embedder.embed(texts))


@pytest.mark.slow
def test_kill_9_then_rerun_through_the_endpoint_gives_each_line_once(embedding_server: Running,
                                                                      tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(embedding_rows(3000)) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--endpoint", embedding_server.v1,
           "--model", EMBEDDING_MODEL, "--no-progress"]
    results = out / "results.jsonl"
    done_before = kill_9_after(cmd, results, 50)
    assert 50 <= done_before < 3000, "the kill did not land mid-way"
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming: " in rerun.stderr
    ids = [json.loads(line)["custom_id"] for line in results.open()]
    assert sorted(ids) == sorted(f"r{i}" for i in range(3000))  # every line once, none twice


# ---- a generation server -----------------------------------------------------------------------
def test_a_generation_server_refuses_embeddings(server: Running) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match=f"text-generation model: this server answers {CHAT_URL}") as e:
        client.embeddings.create(model=MODEL, input="x")
    assert e.value.body["param"] == "model"
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(batch_line("a", {"input": "x"}))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match=f"not {EMBEDDINGS_URL}") as e:
        client.batches.create(input_file_id=uploaded.id, endpoint=EMBEDDINGS_URL, completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    assert client.models.retrieve(MODEL).model_extra["task"] == "generate"
