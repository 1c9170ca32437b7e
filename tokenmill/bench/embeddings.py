"""`tokenmill bench` for an embedding model: inputs/s and tokens/s by batch size (inputs handed to
the model per call) and length mix, what a token costs (µs, as a prefill token does), and $ per
million tokens. Inputs are windows of the bench corpus (real text, workloads.py) cut to exact token
lengths, between the model's own special tokens; no input repeats, so nothing is cached."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.report import md_table
from tokenmill.bench.runner import CpuMeter, environment
from tokenmill.bench.workloads import Corpus, LengthSpec
from tokenmill.cost import usd_per_million

# Length mixes in tokens, special tokens included: search queries, passages, and a corpus's skew
# (most inputs short, a long tail).
MIXES = {"short": LengthSpec(16), "passage": LengthSpec(128), "skewed": LengthSpec(48, "lognormal", 0.8)}
BATCH_SIZES = (1, 8, 32, 256)
MIN_INPUTS = 256  # per run, so that batch 1 runs long enough to time


@dataclass
class EmbeddingPoint:
    mix: str
    batch_size: int
    inputs: int
    tokens: int
    seconds: float
    forwards: int
    other_cpu: float | None  # other processes' share of the machine's CPU during the run (0-1; None: unknown)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def row(self, price: float | None) -> dict[str, Any]:
        return {**asdict(self), "inputs_per_s": self.inputs / self.seconds, "tokens_per_s": self.tokens_per_s,
                "us_per_token": 1e6 * self.seconds / self.tokens, "mean_input_tokens": self.tokens / self.inputs,
                "usd_per_m_tokens": None if price is None else usd_per_million(price, self.tokens_per_s)}


def run_embedding_sweep(embedder: Any, label: str, mixes: dict[str, LengthSpec], batch_sizes: Sequence[int],
                        runs: int, seed: int, price: float | None, price_source: str | None,
                        log: Callable[[str], None]) -> dict[str, Any]:
    """Each mix at each batch size, `runs` times (the median by tokens/s kept). `embedder`: an
    embedding engine (embed/inputs.py EmbeddingInputs), loaded."""
    corpus, rng = Corpus(embedder.tokenizer, seed), random.Random(seed)
    prefix, suffix = _special_tokens(embedder.tokenizer)
    draw = _inputs_of(corpus, rng, prefix, suffix, embedder.max_model_len)
    embedder.embed_token_ids(draw(LengthSpec(64), 8))  # warm-up: first-call costs (allocations, packing)
    points = []
    for name, mix in mixes.items():
        for batch in batch_sizes:
            measured = [_one_run(embedder, name, batch, draw(mix, -(-max(batch, MIN_INPUTS) // batch) * batch))
                        for _ in range(runs)]
            point = sorted(measured, key=lambda p: p.tokens_per_s)[(runs - 1) // 2]  # the median (lower, if even)
            log(f"{name} batch {batch}: {point.tokens_per_s:,.0f} tok/s, {point.inputs / point.seconds:,.1f} "
                f"inputs/s (other processes: {_share(point.other_cpu)} CPU)")
            points.append(point.row(price))
    return {"label": label, "kind": "embedding", "dimensions": embedder.dimensions,
            "mixes": {name: vars(mix) for name, mix in mixes.items()},
            "sweep": {"batch_sizes": list(batch_sizes), "runs": runs, "seed": seed, "price_per_hour": price,
                      "price_source": price_source},
            "environment": environment(), "points": points}


def _share(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text ([CLS] / [SEP] for BERT, an EOS for some
    decoder embedders)."""
    bare = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
    return full[:at], full[at + len(bare):]


def _inputs_of(corpus: Corpus, rng: random.Random, prefix: list[int], suffix: list[int],
               limit: int) -> Callable[[LengthSpec, int], list[list[int]]]:
    extra = len(prefix) + len(suffix)

    def draw(mix: LengthSpec, count: int) -> list[list[int]]:
        lengths = [min(max(mix.sample(rng), extra + 1), limit) for _ in range(count)]
        return [prefix + corpus.take(n - extra) + suffix for n in lengths]

    return draw


def _one_run(embedder: Any, mix: str, batch: int, inputs: list[list[int]]) -> EmbeddingPoint:
    forwards0, meter, start = embedder.stats.forwards, CpuMeter(), time.perf_counter()
    for at in range(0, len(inputs), batch):
        embedder.embed_token_ids(inputs[at:at + batch])
    seconds = time.perf_counter() - start
    others = meter.other_seconds()
    return EmbeddingPoint(mix, batch, len(inputs), sum(map(len, inputs)), seconds, embedder.stats.forwards - forwards0,
                          None if others is None else others / seconds / (os.cpu_count() or 1))


# ---- reports -------------------------------------------------------------------------------------
COLUMNS = [("mix", "mix", "{}"), ("batch_size", "batch", "{:d}"), ("mean_input_tokens", "mean in tok", "{:,.1f}"),
           ("inputs_per_s", "inputs/s", "{:,.1f}"), ("tokens_per_s", "tok/s", "{:,.0f}"),
           ("us_per_token", "µs/token", "{:,.1f}"), ("forwards", "forwards", "{:d}"),
           ("usd_per_m_tokens", "$/M tokens", "{:,.4f}"), ("other_cpu", "other CPU", "{:.0%}")]


def rows(data: dict[str, Any]) -> list[dict[str, str]]:
    return [{header: "–" if p[key] is None else spec.format(p[key]) for key, header, spec in COLUMNS}
            for p in data["points"]]


def write_reports(data: dict[str, Any], out: Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png (tokens/s by batch size, a line per mix) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    env, sweep = data["environment"], data["sweep"]
    hourly = sweep["price_per_hour"]
    price = "none given" if hourly is None else f"${hourly:g}/h ({sweep['price_source']})"
    mixes = ", ".join(f"{n} ({m['dist']} mean {m['mean']})" for n, m in data["mixes"].items())
    paths["md"].write_text("\n".join([
        f"# tokenmill bench: {data['label']}", "",
        f"Embeddings of {data['dimensions']} dimensions. Length mixes: {mixes}; {sweep['runs']} run(s) per point, "
        f"median. Price: {price}. Machine: {env.get('cpu')} x{env.get('cpu_count')}, torch threads "
        f"{env.get('torch_threads')}; {env.get('created_utc')}.", "", md_table(rows(data)), ""]))
    _plot(data, paths["png"])
    return paths


def compare(datasets: list[dict[str, Any]]) -> str:
    """Engines measured in one run, point by point: each one's tokens/s, and the first's ratio to
    each of the others."""
    first, others = datasets[0], datasets[1:]
    names = [d["label"] for d in datasets]
    head = ["mix", "batch", *[f"{n} tok/s" for n in names], *[f"× {n}" for n in names[1:]]]
    table = []
    for at, point in enumerate(first["points"]):
        theirs = [d["points"][at] for d in others]
        assert all((p["mix"], p["batch_size"]) == (point["mix"], point["batch_size"]) for p in theirs)
        table.append(dict(zip(head, [point["mix"], str(point["batch_size"]),
                                     *[f"{p['tokens_per_s']:,.0f}" for p in [point, *theirs]],
                                     *[f"{point['tokens_per_s'] / p['tokens_per_s']:.2f}×" for p in theirs]],
                          strict=True)))
    return md_table(table)


def _plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mix in data["mixes"]:
        points = [p for p in data["points"] if p["mix"] == mix]
        ax.plot([p["batch_size"] for p in points], [p["tokens_per_s"] for p in points], marker="o", label=mix)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (inputs per call)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"tokenmill bench · {data['label']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def terminal(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmill bench · {data['label']}")
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="right")
    for row in rows(data):
        table.add_row(*row.values())
    Console().print(table)
