"""What `--weight-format q8` costs in accuracy on a retrieval set: the cosine of each q8 vector to
its fp32 one (mean and worst), and how often a query's nearest documents stay the same.

    python benchmarks/embedding_accuracy.py [--docs 3000] [--queries 500] [--out benchmarks/results]

The set: windows of 20-120 words of real English (benchmarks/corpus.txt) as documents (cut to the
model's 256 tokens where longer), and as
queries a shorter piece of one document with a few of its words dropped, so each query has a
right answer among near misses. fp32 (exact: sentence-transformers' vectors to 0.99999) is the
reference; a ranking is "unchanged" when q8 puts the same document first (top-1), or the same ten
documents first in the same order (top-10; also as a set). Near ties flip under any rounding, so
top-1 is also counted over the queries whose fp32 first is ahead of its second by CLEAR_MARGIN.
Writes embedding_accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from tokenmill.embed.config import MAX_TRUNCATE
from tokenmill.embed.embedder import Embedder

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
CLEAR_MARGIN = 0.01  # fp32's first document ahead of its second by this much cosine


def retrieval_set(docs: int, queries: int, seed: int) -> tuple[list[str], list[str], list[int]]:
    """(documents, queries, the document each query was cut from)."""
    words = CORPUS.read_text().split()
    rng = random.Random(seed)
    documents = []
    for _ in range(docs):
        size = rng.randint(20, 120)
        start = rng.randrange(len(words) - size)
        documents.append(" ".join(words[start:start + size]))
    sources = [rng.randrange(docs) for _ in range(queries)]
    asked = []
    for source in sources:
        piece = documents[source].split()[: rng.randint(6, 16)]
        asked.append(" ".join(w for w in piece if rng.random() > 0.15) or piece[0])
    return documents, asked, sources


def rankings(docs: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Each query's k nearest documents, nearest first (the vectors are unit length)."""
    return np.argsort(-(queries @ docs.T), axis=1, kind="stable")[:, :k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=3000)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    documents, queries, sources = retrieval_set(args.docs, args.queries, args.seed)
    vectors = {}
    for fmt in ("fp32", "q8"):
        embedder = Embedder(weight_format=fmt)
        vectors[fmt] = (embedder.embed(documents, truncate=MAX_TRUNCATE), embedder.embed(queries))
    cosines = np.concatenate([(a * b).sum(1) for a, b in zip(vectors["fp32"], vectors["q8"], strict=True)])
    exact, q8 = (rankings(*vectors[fmt], 10) for fmt in ("fp32", "q8"))
    docs, queries_fp32 = vectors["fp32"]
    scores = np.sort(queries_fp32 @ docs.T, axis=1)
    clear = scores[:, -1] - scores[:, -2] > CLEAR_MARGIN  # fp32's first is not a near tie
    report = {
        "command": f"python benchmarks/embedding_accuracy.py --docs {args.docs} --queries {args.queries} "
                   f"--seed {args.seed}",
        "vectors": len(cosines), "cosine_mean": float(cosines.mean()), "cosine_min": float(cosines.min()),
        "top1_unchanged": float((exact[:, 0] == q8[:, 0]).mean()),
        "top10_unchanged": float((exact == q8).all(1).mean()),
        "top10_same_set": float(np.mean([set(a) == set(b) for a, b in zip(exact, q8, strict=True)])),
        "queries_with_a_clear_first": int(clear.sum()),
        "top1_unchanged_where_clear": float((exact[clear, 0] == q8[clear, 0]).mean()),
        "fp32_top1_is_source": float((exact[:, 0] == np.array(sources)).mean()),
        "q8_top1_is_source": float((q8[:, 0] == np.array(sources)).mean()),
    }
    print(json.dumps(report, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embedding_accuracy.json").write_text(json.dumps(report, indent=1))
    rows = [f"| {name} | {value:.6f} |" if isinstance(value, float) else f"| {name} | {value} |"
            for name, value in report.items() if name != "command"]
    (args.out / "embedding_accuracy.md").write_text(
        f"`{report['command']}`\n\n| q8 against fp32 | |\n|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
