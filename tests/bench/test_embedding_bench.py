"""`tokenmill bench` with an embedding model: every point measured on inputs of the lengths asked
for, counted as the model counts them, with its reports written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.test_cli_and_formats import parse
from tokenmill.bench import cli


def test_an_embedding_model_is_benched_by_batch_size_and_length_mix(tmp_path: Path) -> None:
    args = parse("--model", "all-minilm-l6-v2", "--batch-sizes", "1,16", "--input-len", "12", "--runs", "2",
                 "--price-per-hour", "0.5", "--out", str(tmp_path), "--max-num-batched-tokens", "64")
    assert cli.run(args) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["kind"] == "embedding" and data["dimensions"] == 384
    assert [(p["mix"], p["batch_size"]) for p in data["points"]] == [("custom", 1), ("custom", 16)]
    for point in data["points"]:
        assert point["tokens"] == 12 * point["inputs"] and point["inputs"] >= 256
        assert point["tokens_per_s"] == pytest.approx(point["tokens"] / point["seconds"])
        assert point["usd_per_m_tokens"] == pytest.approx(0.5 / 3600 / point["tokens_per_s"] * 1e6)
    one, sixteen = data["points"]
    assert one["forwards"] == one["inputs"]  # a call of one input is one forward
    assert sixteen["forwards"] == sixteen["inputs"] // 16 * 4  # 5 inputs of 12 tokens a 64-token forward
    assert (tmp_path / "bench.md").read_text().count("| custom |") == 2
    assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--output-len", "8"], "--output-len: not for an embedding model"),
    (["--block-size", "32"], "--block-size: not for an embedding model"),
    (["--engine", "vllm", "--weight-format", "q8"], "--weight-format: tokenmill's embedder's, not vLLM's"),
])
def test_generation_flags_are_refused_for_an_embedding_model(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cli.run(parse("--model", "all-minilm-l6-v2", *flags))


def test_engines_measured_together_are_compared_point_by_point() -> None:
    from tokenmill.bench.embeddings import compare

    def data(label: str, speeds: list[float]) -> dict:
        return {"label": label, "points": [{"mix": "short", "batch_size": b, "tokens_per_s": v}
                                           for b, v in zip((1, 8), speeds, strict=True)]}

    table = compare([data("a", [300.0, 900.0]), data("b", [100.0, 1000.0])]).splitlines()
    assert table[0] == "| mix | batch | a tok/s | b tok/s | × b |"
    assert table[2:] == ["| short | 1 | 300 | 100 | 3.00× |", "| short | 8 | 900 | 1,000 | 0.90× |"]
