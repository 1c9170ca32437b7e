"""Bench workloads: prompts built from real text cut to exact token lengths.

A `Workload` draws `Request`s. Synthetic prompts are windows of `benchmarks/corpus.txt`
(real English prose, tokenised once), never random token ids: random ids make attention and
sampling behave unlike real use. Each window starts at an offset never used before in the
sweep, so runs do not share a prefix and cannot hit each other's prefix cache; only the
shared-prefix workload reuses text on purpose.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[2] / "benchmarks" / "corpus.txt"
DISTRIBUTIONS = ("fixed", "uniform", "lognormal")


@dataclass
class Request:
    prompt_token_ids: list[int] | None  # exact ids (synthetic workloads)
    prompt: str | None  # text, for JSONL prompts and for endpoints
    input_len: int  # requested input tokens (for JSONL prompts: as tokenised here)
    output_len: int  # requested output tokens, enforced with min_tokens / ignore_eos


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution: `mean` tokens, spread by `spread` (uniform: +/- fraction of the
    mean; lognormal: sigma of the underlying normal, median = mean x exp(-sigma^2/2))."""

    mean: int
    dist: str = "fixed"
    spread: float = 0.5

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {self.dist!r}")

    def sample(self, rng: random.Random) -> int:
        if self.dist == "uniform":
            half = self.mean * min(self.spread, 1.0)
            return max(1, round(rng.uniform(self.mean - half, self.mean + half)))
        if self.dist == "lognormal":
            # mu chosen so that the distribution's mean is `mean`.
            mu = math.log(self.mean) - self.spread**2 / 2
            return max(1, round(rng.lognormvariate(mu, self.spread)))
        return self.mean


class Corpus:
    """The corpus as token ids; hands out windows at offsets not used before."""

    def __init__(self, tokenizer: Any, seed: int, path: Path = CORPUS) -> None:
        self.ids: list[int] = list(tokenizer.encode(path.read_text(), add_special_tokens=False))
        self.rng = random.Random(seed)
        self.used: set[int] = set()

    def take(self, n: int) -> list[int]:
        if n > len(self.ids):
            # Longer than the corpus: repeat it (still real text, and still a fresh start offset).
            reps = n // len(self.ids) + 2
            base = self.ids * reps
        else:
            base = self.ids + self.ids[:n]  # wrap around, so every offset gives n tokens
        for _ in range(1000):
            start = self.rng.randrange(len(self.ids))
            if start not in self.used:
                self.used.add(start)
                return base[start : start + n]
        raise ValueError("the corpus has no unused start offsets left: use fewer requests")


@dataclass
class Workload:
    """Synthetic (`input`/`output` lengths, optional shared prefix) or JSONL prompts."""

    input: LengthSpec
    output: LengthSpec
    prefix_len: int = 0  # shared-prefix workload: tokens of system prompt reused
    num_prefixes: int = 1
    jsonl: Path | None = None
    name: str = "fixed"

    @property
    def expects_cache_hits(self) -> bool:
        return self.prefix_len > 0

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "input": vars(self.input), "output": vars(self.output),
                "prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes,
                "jsonl": str(self.jsonl) if self.jsonl else None}

    def make(self, n: int, corpus: Corpus, rng: random.Random, tokenizer: Any) -> list[Request]:
        if self.jsonl is not None:
            return _from_jsonl(self.jsonl, n, rng, tokenizer, self.output)
        prefixes = [corpus.take(self.prefix_len) for _ in range(self.num_prefixes)] if self.prefix_len else []
        requests = []
        for i in range(n):
            length = max(self.input.sample(rng), self.prefix_len + 1)
            head = prefixes[i % len(prefixes)] if prefixes else []
            ids = head + corpus.take(length - len(head))
            requests.append(Request(ids, None, length, self.output.sample(rng)))
        return requests


def _from_jsonl(path: Path, n: int, rng: random.Random, tokenizer: Any, output: LengthSpec) -> list[Request]:
    """Real prompts: lines with `prompt` (text), `messages` (chat) or `prompt_token_ids`, and
    an optional `max_tokens`. Drawn with replacement when the file has fewer than n lines."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"prompts: {path} has no prompts")
    picked = rng.sample(rows, n) if n <= len(rows) else [rng.choice(rows) for _ in range(n)]
    requests = []
    for row in picked:
        ids = _row_ids(row, tokenizer, path)
        out = int(row.get("max_tokens") or output.sample(rng))
        requests.append(Request(ids, tokenizer.decode(ids), len(ids), out))
    return requests


def _row_ids(row: dict[str, Any], tokenizer: Any, path: Path) -> list[int]:
    if "prompt_token_ids" in row:
        return [int(t) for t in row["prompt_token_ids"]]
    if "messages" in row:
        from tokenmill.engine import chat_prompt_ids  # here: endpoint benchmarks need no torch

        return chat_prompt_ids(tokenizer, row["messages"], row.get("chat_template_kwargs"))
    if "prompt" in row:
        return list(tokenizer.encode(str(row["prompt"])))
    raise ValueError(f"prompts: each line of {path} needs 'prompt', 'messages' or 'prompt_token_ids'")
