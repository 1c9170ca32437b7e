"""`/v1/embeddings` rows through `tokenmill run` on the embedding backend: one OpenAI-shaped row
per line with the vectors sentence-transformers gives, bad rows in the errors file, documents and
CSV rows embedded with their metadata kept, flags that cannot apply refused by name, and exactly
one row per line after a kill -9 and a re-run."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from tokenmill.embed.embedder import Embedder
from tokenmill.jobs.backends.embedding import EmbeddingBackend
from tokenmill.jobs.config import JobConfig
from tokenmill.jobs.runner import run_job

from .conftest import assert_exactly_once, kill_9_after, read_jsonl, write_jsonl

TEXTS = ["A kettle that boils fast.", "The lid broke after a week.", "great value", "Arrived late, scratched.",
         "My kids love it and so do I: light, quiet and it keeps the tea hot for hours."]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.fixture(scope="module")
def reference(embedder: Embedder) -> SentenceTransformer:
    return SentenceTransformer(str(embedder.folder), device="cpu")


def embedding_line(custom_id: str, value: object, **body: object) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"input": value, **body}}


def vectors(row: dict[str, object]) -> np.ndarray:
    data = row["response"]["body"]["data"]  # type: ignore[index]
    return np.array([d["embedding"] if isinstance(d["embedding"], list)
                     else np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])


def test_a_batch_file_of_embedding_rows(tmp_path: Path, embedder: Embedder, reference: SentenceTransformer) -> None:
    lines = [embedding_line("one", TEXTS[0]), embedding_line("many", TEXTS[1:]),
             embedding_line("b64", TEXTS[2], encoding_format="base64"),
             embedding_line("ids", embedder.tokenize([TEXTS[3]])[0]),
             embedding_line("long", "word " * 300), embedding_line("cut", "word " * 300, truncate_prompt_tokens=-1),
             embedding_line("empty", ""), embedding_line("wide", "x", dimensions=768),
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    config = JobConfig(input=path, output=tmp_path / "out", progress=False)
    outcome = run_job(config, EmbeddingBackend(embedder=embedder))
    assert_exactly_once(tmp_path / "out", len(lines))
    rows = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out" / "results.jsonl")}
    assert sorted(rows) == ["b64", "cut", "ids", "many", "one"]
    expected = reference.encode(TEXTS)
    for custom_id, at in (("one", slice(0, 1)), ("many", slice(1, 5)), ("b64", slice(2, 3)), ("ids", slice(3, 4))):
        mine = vectors(rows[custom_id])
        assert ((mine * expected[at]).sum(1) > 0.99999).all(), custom_id
    body = rows["many"]["response"]["body"]
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["model"] == "all-minilm-l6-v2"
    assert body["usage"]["prompt_tokens"] == sum(len(ids) for ids in embedder.tokenize(TEXTS[1:]))
    assert rows["cut"]["response"]["body"]["usage"]["prompt_tokens"] == 256
    errors = {e["custom_id"]: e["error"]["message"] for e in read_jsonl(tmp_path / "out" / "errors.jsonl")}
    assert "302 tokens, over all-minilm-l6-v2's limit of 256" in errors["long"]
    assert "body.input is an empty string" in errors["empty"]
    assert "body.dimensions = 768: all-minilm-l6-v2 makes vectors of 384" in errors["wide"]
    assert "all-minilm-l6-v2 is an embedding model: it answers /v1/embeddings rows" in errors["chat"]
    assert outcome.tokens.vectors == 8 and outcome.tokens.completion == 0
    assert outcome.throughput.input_tok_s and outcome.throughput.vectors_per_s


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenmill", "run", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=timeout)


def test_documents_and_csv_rows_are_embedded_with_their_columns_kept(tmp_path: Path,
                                                                    reference: SentenceTransformer) -> None:
    (tmp_path / "docs.txt").write_text("\n".join(TEXTS) + "\n")
    done = run_cli(str(tmp_path / "docs.txt"), "-o", str(tmp_path / "docs"), "--embed", "--price-per-hour", "1")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(tmp_path / "docs" / "results.jsonl")
    by_line = {r["custom_id"]: vectors(r)[0] for r in rows}
    mine = np.array([by_line[f"line-{i + 1}"] for i in range(len(TEXTS))])
    assert ((mine * reference.encode(TEXTS)).sum(1) > 0.99999).all()
    assert "per M input tokens" in done.stdout and "vectors/s" in done.stdout
    summary = json.loads((tmp_path / "docs" / "summary.json").read_text())
    assert summary["backend"] == "embedding" and summary["cost"]["usd_per_million_input_tokens"] > 0

    (tmp_path / "t.csv").write_text("id,text,shop\n" + "".join(f"r{i},\"{t}\",s{i}\n" for i, t in enumerate(TEXTS)))
    done = run_cli(str(tmp_path / "t.csv"), "-o", str(tmp_path / "csv"), "--model", "all-minilm-l6-v2")
    assert done.returncode == 0, done.stderr
    rows = {r["custom_id"]: r for r in read_jsonl(tmp_path / "csv" / "results.jsonl")}
    assert rows["r3"]["metadata"] == {"shop": "s3"}
    assert (vectors(rows["r3"])[0] * reference.encode(TEXTS[3])).sum() > 0.99999


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-num-seqs", "4"], "--max-num-seqs: not for an embedding model"),
    (["--engine", "vllm", "--weight-format", "q8"], "--weight-format: tokenmill's embedder's, not vLLM's"),
    (["--engine", "vllm", "--max-num-seqs", "4"], "--max-num-seqs: not for an embedding model"),
    (["--embed", "--model", "smollm2"], "--model smollm2 is not an embedding model"),
    (["--embed", "--completions"], "--embed and --completions send documents to two different endpoints"),
])
def test_flags_an_embedding_model_cannot_take_are_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    (tmp_path / "docs.txt").write_text("a\n")
    model = [] if "--model" in flags else ["--model", "all-minilm-l6-v2"]
    done = run_cli(str(tmp_path / "docs.txt"), "-o", str(tmp_path / "out"), *model, *flags, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr


@pytest.mark.slow
def test_kill_9_then_rerun_embeds_each_line_exactly_once(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [embedding_line(f"r{i}", f"document {i} " * (1 + i % 40))
                                                for i in range(3000)])
    out = tmp_path / "out"
    cmd = [str(path), "-o", str(out), "--model", "all-minilm-l6-v2", "--sort-window", "64"]
    results = out / "results.jsonl"
    done_before = kill_9_after([sys.executable, "-m", "tokenmill", "run", *cmd, "--no-progress"], results, 64)
    assert 64 <= done_before < 3000, "the kill did not land mid-way"
    rerun = run_cli(*cmd)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {done_before} done" in rerun.stderr
    assert_exactly_once(out, 3000)


def test_parquet_output_holds_each_vector_as_a_fixed_size_list(tmp_path: Path, embedder: Embedder) -> None:
    import pyarrow as pa
    import pyarrow.dataset as ds

    lines = [embedding_line("one", TEXTS[0]), embedding_line("b64", TEXTS[1], encoding_format="base64"),
             embedding_line("two", TEXTS[2:4])]
    config = JobConfig(input=write_jsonl(tmp_path / "in.jsonl", lines), output=tmp_path / "out", progress=False,
                       output_format="parquet")
    assert run_job(config, EmbeddingBackend(embedder=embedder)).status == "done"
    table = ds.dataset(tmp_path / "out" / "results").to_table()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    vectors = dict(zip(table["custom_id"].to_pylist(), table["embedding"].to_pylist(), strict=True))
    np.testing.assert_allclose(vectors["one"], embedder.embed(TEXTS[:1])[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vectors["b64"], embedder.embed(TEXTS[1:2])[0], rtol=1e-5, atol=1e-6)
    assert vectors["two"] is None  # several inputs: their vectors are in the body


class _CountsCloses(Embedder):
    closes = 0

    def close(self) -> None:
        type(self).closes += 1


def test_a_built_backend_closes_the_model_it_loaded_and_only_that(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's engine processes must stop when the job is done, not at interpreter exit (where they
    can abort the process after its results are written); a model the caller handed in is the caller's."""
    import tokenmill.engines
    from tokenmill.embed.config import EmbeddingConfig
    from tokenmill.jobs.backends import built_backend

    monkeypatch.setattr(tokenmill.engines, "load_embedder", lambda spec: _CountsCloses())
    path = write_jsonl(tmp_path / "in.jsonl", [embedding_line("one", TEXTS[0])])
    with built_backend(EmbeddingConfig()) as backend:
        run_job(JobConfig(input=path, output=tmp_path / "out", progress=False), backend)
        assert _CountsCloses.closes == 0
    assert _CountsCloses.closes == 1
    lent = _CountsCloses()
    EmbeddingBackend(embedder=lent).close()
    assert _CountsCloses.closes == 1
