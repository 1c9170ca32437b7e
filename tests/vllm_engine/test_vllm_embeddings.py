"""--engine vllm with an embedding model: `/v1/embeddings` rows through vLLM's pooling runner, the
vectors tokenmill's own embedder makes (itself held to sentence-transformers at cosine 0.99999),
the same per-row refusals. `make test-vllm` runs it in .venv-vllm."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.jobs.conftest import read_jsonl, write_jsonl

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs these in .venv-vllm")
pytestmark = pytest.mark.slow

from tokenmill.embed.embedder import Embedder  # noqa: E402

TEXTS = ["The cat sat on the mat.", "A kitten rested on a rug.", "Quarterly revenue rose by 4%.", "hello",
         "Paris is the capital of France. " * 12]


def embedding_line(custom_id: str, value: object, **body: object) -> dict[str, object]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "all-minilm-l6-v2", "input": value, **body}}


def test_a_job_embeds_through_vllms_pooling_runner(tmp_path: Path) -> None:
    lines = [embedding_line(f"r{i}", text) for i, text in enumerate(TEXTS)]
    lines += [embedding_line("many", TEXTS[:3]), embedding_line("ids", [101, 7592, 2088, 102]),
              embedding_line("long", "word " * 400), embedding_line("wide", "x", dimensions=768)]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "tokenmill", "run", str(path), "-o", str(out), "--engine", "vllm",
                           "--model", "all-minilm-l6-v2", "--engine-arg", "enforce_eager=true", "--no-progress"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 1 and "2 request(s) failed" in done.stderr, done.stderr[-3000:]  # long, wide
    rows = {r["custom_id"]: r["response"]["body"] for r in read_jsonl(out / "results.jsonl")}
    errors = {r["custom_id"]: r["error"]["message"] for r in read_jsonl(out / "errors.jsonl")}
    assert set(errors) == {"long", "wide"}
    assert "over all-minilm-l6-v2's limit of 256" in errors["long"]
    assert "makes vectors of 384 and cannot shorten them" in errors["wide"]

    embedder = Embedder()
    reference = embedder.embed(TEXTS)
    for i in range(len(TEXTS)):
        vector = np.asarray(rows[f"r{i}"]["data"][0]["embedding"], dtype=np.float32)
        assert float(vector @ reference[i]) > 0.9999
    assert [d["index"] for d in rows["many"]["data"]] == [0, 1, 2]
    assert rows["many"]["usage"]["prompt_tokens"] == sum(map(len, embedder.tokenize(TEXTS[:3])))
    ids_vector = np.asarray(rows["ids"]["data"][0]["embedding"], dtype=np.float32)
    assert float(ids_vector @ embedder.embed_token_ids([[101, 7592, 2088, 102]])[0]) > 0.9999
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"]["vectors"] == len(TEXTS) + 3 + 1
