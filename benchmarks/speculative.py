"""Speculative decoding on the embedded engine: ngram and suffix against speculation off, and against
llama.cpp's `llama-lookup` (prompt lookup), measured in one run.

    python benchmarks/speculative.py                          # both models, three workloads, B = 1, 8, 32, 64
    python benchmarks/speculative.py --models smollm2 --batches 1,8 --workloads extraction
    python benchmarks/speculative.py --quick                  # a smoke run: numbers mean nothing

Workloads (greedy, prefix caching on, as a batch job runs):
  extraction  documents of 200-400 tokens (an order record in running text among filler sentences),
              each to a JSON object of six fields copied from it, under a JSON schema
  templated   the reviews job of `make demo` (examples/reviews.jsonl), held to its JSON schema
              (examples/review_schema.json): answers repeat across rows
  random      random-token prompts, EOS ignored: nothing to copy, the worst case
A cell is one workload at one batch size: max(3, 2 x B) rows submitted at once to an engine with
max_num_seqs = B, built afresh for each method (its suffix tree and draft budget start empty, so
their learning is in the figure). The figure is end-to-end output tokens per second: output tokens /
the wall time from submitting the rows to the last one finishing, the mean of --repeats runs of each
method taken in alternating order (off, ngram, suffix, suffix, ngram, off), so that a machine
drifting during the cell falls alike on all three. Every cell also checks that each
method's greedy outputs equal speculation off's, row for row (a row that parts is shown with its
step and the top-2 logprob gap there: an fp32 near-tie, see docs/speculative.md), and records the
CPU seconds other processes used meanwhile.

Beside it, llama.cpp's `llama-lookup` (bash benchmarks/setup_llamacpp.sh) at batch 1 on the
extraction rows: the same prompt text, the same schema (--json-schema), greedy, 2 threads, its own
encode + decode time. Writes speculative.{json,md,png} to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter, environment
from tokenmill.engine import StructuredOutputsParams
from tokenmill.environment import embedded_model_path, named_model_path
from tokenmill.models.loader import LoadedWeights, load_weights

ROOT = Path(__file__).resolve().parents[1]
LLAMA_LOOKUP = ROOT / "build/llamacpp/src/vendor/llama.cpp/build/bin/llama-lookup"
METHODS = ("off", "ngram", "suffix")
WORKLOADS = ("extraction", "templated", "random")
MAX_TOKENS = {"extraction": 128, "templated": 48, "random": 64}
FIELDS = ("customer", "company", "email", "order_id", "total", "ship_to")
EXTRACTION_SCHEMA = {"type": "object", "properties": {name: {"type": "string", "maxLength": 48} for name in FIELDS},
                     "required": list(FIELDS), "additionalProperties": False}
FIRST = ["Jane", "Omar", "Li", "Priya", "Marek", "Ana", "Tomas", "Yuki", "Femi", "Clara"]
LAST = ["Doe", "Haddad", "Wei", "Natarajan", "Kowalski", "Souza", "Berg", "Tanaka", "Adeyemi", "Moreau"]
COMPANIES = ["Acme Corp", "Globex Ltd", "Initech GmbH", "Umbrella BV", "Soylent SA", "Hooli Inc", "Vandelay AB"]
STREETS = ["Elm Street", "Harbour Road", "Kings Avenue", "Mill Lane", "Station Square", "Lake Drive"]
CITIES = ["Springfield", "Rotterdam", "Leeds", "Gdansk", "Porto", "Uppsala", "Osaka", "Lagos"]


@dataclass
class Cell:
    model: str
    workload: str
    batch: int
    method: str
    rows: int
    output_tokens: int
    wall_s: float
    out_tok_s: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    propose_s: float | None  # the proposers' own time, all steps together
    identical_rows: int | None = None  # rows whose tokens equal speculation off's (None: off itself)
    parted: list[str] = field(default_factory=list)  # rows that differ: where, and the gap there
    other_cpu_s: float | None = None
    runs_tok_s: list[float] = field(default_factory=list)  # each repeat's rate (out_tok_s: their mean)


# ---- workloads ------------------------------------------------------------------------------------
def _filler(rng: random.Random, words: int) -> str:
    corpus = (ROOT / "benchmarks/corpus.txt").read_text().split()
    start = rng.randrange(len(corpus) - words)
    return " ".join(corpus[start : start + words])


def extraction_rows(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        facts = {"customer": f"{first} {last}", "company": rng.choice(COMPANIES),
                 "email": f"{first.lower()}.{last.lower()}@example.com", "order_id": f"ORD-{rng.randrange(10**5):05d}",
                 "total": f"{rng.randrange(100, 9999)}.{rng.randrange(100):02d} EUR",
                 "ship_to": f"{rng.randrange(1, 200)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"}
        record = (f"Order {facts['order_id']} was placed by {facts['customer']} of {facts['company']} "
                  f"(contact: {facts['email']}). The order total is {facts['total']}, and it ships to "
                  f"{facts['ship_to']}.")
        doc = f"{_filler(rng, rng.randrange(60, 150))}\n\n{record}\n\n{_filler(rng, rng.randrange(40, 90))}"
        ask = ("Extract the order from this document as JSON with the fields " + ", ".join(FIELDS)
               + ", each copied exactly as written.\n\n" + doc)
        rows.append([{"role": "user", "content": ask}])
    return rows


def templated_rows(n: int) -> list[list[dict[str, str]]]:
    lines = (ROOT / "examples/reviews.jsonl").read_text().splitlines()
    return [json.loads(line)["body"]["messages"] for line in lines[:n]]


def random_rows(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(n)]


def workload(name: str, n: int, llm: LLM) -> tuple[list[Any], SamplingParams, bool]:
    """(prompts, params, as chats)."""
    if name == "extraction":
        so = StructuredOutputsParams(json=EXTRACTION_SCHEMA)
        return extraction_rows(n), SamplingParams(max_tokens=MAX_TOKENS[name], temperature=0, structured_outputs=so,
                                                  logprobs=2), True
    if name == "templated":
        so = StructuredOutputsParams(json=json.loads((ROOT / "examples/review_schema.json").read_text()))
        return templated_rows(n), SamplingParams(max_tokens=MAX_TOKENS[name], temperature=0, structured_outputs=so,
                                                 logprobs=2), True
    prompts = [{"prompt_token_ids": p} for p in random_rows(n, llm.engine.model_config.vocab_size)]
    return prompts, SamplingParams(max_tokens=MAX_TOKENS[name], temperature=0, ignore_eos=True, logprobs=2), False


# ---- one cell -------------------------------------------------------------------------------------
def run_cell(weights: LoadedWeights, model: str, name: str, batch: int, method: str, threads: int) -> tuple[Cell, list]:
    llm = LLM(weights=weights, max_num_seqs=batch, max_model_len=1024, num_threads=threads,
              speculative_method=None if method == "off" else method)
    rows = max(3, 2 * batch)
    prompts, params, chats = workload(name, rows, llm)
    if chats and not _has_chat_template(llm):
        prompts, chats = [{"prompt": _base_prompt(chat)} for chat in prompts], False
    meter, start = CpuMeter(), time.perf_counter()
    outs = llm.chat(prompts, params, progress=False) if chats else llm.generate(prompts, params, progress=False)
    wall = time.perf_counter() - start
    stats = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    drafter = llm.engine.drafter
    cell = Cell(model, name, batch, method, rows, tokens, round(wall, 3), round(tokens / wall, 1),
                stats.draft_acceptance_rate, stats.mean_acceptance_length,
                None if drafter is None else round(drafter.seconds, 3), other_cpu_s=meter.other_seconds())
    return cell, outs


def _has_chat_template(llm: LLM) -> bool:
    return bool(getattr(llm.tokenizer, "chat_template", None))


def _base_prompt(chat: list[dict[str, str]]) -> str:
    """A conversation as plain text, for a base model without a chat template."""
    return "\n\n".join(turn["content"] for turn in chat) + "\nJSON: "


def _prompt_text(llm: LLM, chat: list[dict[str, str]]) -> str:
    if _has_chat_template(llm):
        return llm.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return _base_prompt(chat)


def compare_outputs(cell: Cell, plain: list, drafted: list) -> None:
    cell.identical_rows = 0
    for a, b in zip(plain, drafted, strict=True):
        step = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        if step is None and len(a.token_ids) == len(b.token_ids):
            cell.identical_rows += 1
            continue
        step = min(len(a.token_ids), len(b.token_ids)) if step is None else step
        gap = None
        if a.logprobs and step < len(a.logprobs) and len(a.logprobs[step].top) > 1:
            top = a.logprobs[step].top
            gap = round(top[0][1] - top[1][1], 6)
        cell.parted.append(f"{a.request_id}: step {step}, top-2 gap {gap}")


# ---- llama-lookup ---------------------------------------------------------------------------------
def llama_lookup(path: Path, llm: LLM, threads: int) -> dict[str, Any] | None:
    """llama-lookup on the batch-1 extraction rows: output tokens over its encode + decode seconds."""
    if not LLAMA_LOOKUP.exists():
        print(f"(no {LLAMA_LOOKUP}: bash benchmarks/setup_llamacpp.sh builds it)", file=sys.stderr)
        return None
    tokens, seconds, accepted, drafted = 0, 0.0, 0, 0
    meter = CpuMeter()
    for chat in extraction_rows(3):
        text = _prompt_text(llm, chat)
        run = subprocess.run(
            [str(LLAMA_LOOKUP), "-m", str(path), "-p", text, "-n", str(MAX_TOKENS["extraction"]), "--temp", "0",
             "-t", str(threads), "-c", "2048", "--json-schema", json.dumps(EXTRACTION_SCHEMA)],
            capture_output=True, text=True, timeout=600, check=True)
        log = run.stderr
        encode = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        decode = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        if encode is None or decode is None:
            raise RuntimeError(f"llama-lookup printed no timings:\n{log[-2000:]}")
        tokens += int(decode.group(1))
        seconds += float(encode.group(2)) + float(decode.group(2))
        accepted += int(re.search(r"n_accept\s+=\s+(\d+)", log).group(1))  # type: ignore[union-attr]
        drafted += int(re.search(r"n_drafted\s+=\s+(\d+)", log).group(1))  # type: ignore[union-attr]
    return {"rows": 3, "output_tokens": tokens, "seconds": round(seconds, 3), "out_tok_s": round(tokens / seconds, 1),
            "acceptance_rate": accepted / drafted if drafted else None, "other_cpu_s": meter.other_seconds()}


# ---- the run --------------------------------------------------------------------------------------
def model_path(name: str) -> Path:
    return embedded_model_path() if name == "smollm2" else named_model_path(name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    cells: list[Cell] = []
    lookups: dict[str, Any] = {}
    for model in args.models:
        path = model_path(model)
        weights = load_weights(str(path))
        for name in args.workloads:
            for batch in args.batches:
                plain: list = []
                runs: dict[str, list[Cell]] = {method: [] for method in METHODS}
                for turn in range(args.repeats):  # off, ngram, suffix, then the other way round: drift cancels
                    for method in METHODS if turn % 2 == 0 else METHODS[::-1]:
                        cell, outs = run_cell(weights, model, name, batch, method, args.threads)
                        if method == "off":
                            plain = plain or outs
                        else:
                            compare_outputs(cell, plain, outs)
                        runs[method].append(cell)
                for method in METHODS:
                    cells.append(_mean(runs[method]))
                    print(_line(cells[-1], cells), flush=True)
        if "extraction" in args.workloads and 1 in args.batches and not args.no_llama:
            lookups[model] = llama_lookup(path, LLM(weights=weights, max_num_seqs=1), args.threads)
            print(f"{model} llama-lookup extraction B=1: {lookups[model]}", flush=True)
    return {"environment": environment(), "command": " ".join(sys.argv), "cells": [asdict(c) for c in cells],
            "llama_lookup": lookups}


def _mean(runs: list[Cell]) -> Cell:
    """One cell from its repeats: the mean rate, each run's rate beside it, rows identical in every run."""
    first = runs[0]
    return replace(first, out_tok_s=round(sum(c.out_tok_s for c in runs) / len(runs), 1),
                   runs_tok_s=[c.out_tok_s for c in runs], wall_s=round(sum(c.wall_s for c in runs), 3),
                   identical_rows=None if first.identical_rows is None else min(c.identical_rows or 0 for c in runs),
                   parted=[p for c in runs for p in c.parted],
                   other_cpu_s=round(sum(c.other_cpu_s or 0.0 for c in runs), 2))


def _off(cells: list[Cell], cell: Cell) -> Cell:
    return next(c for c in cells if (c.model, c.workload, c.batch, c.method) == (cell.model, cell.workload, cell.batch,
                                                                                  "off"))


def _line(cell: Cell, cells: list[Cell]) -> str:
    ratio = "" if cell.method == "off" else f" x{cell.out_tok_s / _off(cells, cell).out_tok_s:.2f}"
    acc = ("" if cell.acceptance_rate is None
           else f" accept {cell.acceptance_rate:.0%} len {cell.mean_acceptance_length:.2f}")
    same = "" if cell.identical_rows is None else f" identical {cell.identical_rows}/{cell.rows}"
    return (f"{cell.model} {cell.workload} B={cell.batch} {cell.method}: {cell.out_tok_s:,.1f} out tok/s{ratio}{acc}"
            f"{same} (other CPU {cell.other_cpu_s} s)")


def markdown(results: dict[str, Any]) -> str:
    cells = [Cell(**c) for c in results["cells"]]
    lines = ["| model | workload | B | off tok/s | ngram | suffix | accepted (ngram / suffix) | identical rows | "
             "other CPU s |", "|---|---|---|---|---|---|---|---|---|"]
    for off in (c for c in cells if c.method == "off"):
        drafted = [c for c in cells if (c.model, c.workload, c.batch) == (off.model, off.workload, off.batch)
                   and c.method != "off"]
        ratios = [f"{c.out_tok_s / off.out_tok_s:.2f}x" for c in drafted]
        accepted = " / ".join("-" if c.acceptance_rate is None else f"{c.acceptance_rate:.0%}" for c in drafted)
        same = " / ".join(f"{c.identical_rows}/{c.rows}" for c in drafted)
        cpu = max([off.other_cpu_s or 0.0, *[c.other_cpu_s or 0.0 for c in drafted]])
        lines.append(f"| {off.model} | {off.workload} | {off.batch} | {off.out_tok_s:,.1f} | {' | '.join(ratios)} | "
                     f"{accepted} | {same} | {cpu:.1f} |")
    for model, lookup in results["llama_lookup"].items():
        if lookup is None:
            continue
        mine = {c.method: c.out_tok_s for c in cells if (c.model, c.workload, c.batch) == (model, "extraction", 1)}
        lines.append("")
        lines.append(f"{model}, extraction at B=1: llama-lookup {lookup['out_tok_s']:,.1f} out tok/s "
                     f"(accepted {lookup['acceptance_rate']:.0%}); tokenmill ngram {mine['ngram']:,.1f} "
                     f"(x{mine['ngram'] / lookup['out_tok_s']:.2f}), suffix {mine['suffix']:,.1f} "
                     f"(x{mine['suffix'] / lookup['out_tok_s']:.2f}), off {mine['off']:,.1f}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [Cell(**c) for c in results["cells"]]
    panels = sorted({(c.model, c.workload) for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for ax, (model, name) in zip(axes[0], panels, strict=True):
        for method in METHODS[1:]:
            points = sorted((c.batch, c.out_tok_s / _off(cells, c).out_tok_s) for c in cells
                            if (c.model, c.workload, c.method) == (model, name, method))
            ax.plot([b for b, _ in points], [r for _, r in points], marker="o", label=method)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}: {name}", fontsize=9)
        ax.set_xlabel("batch size")
        ax.set_ylabel("out tok/s vs off")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m", type=lambda s: s.split(","))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: s.split(","))
    parser.add_argument("--batches", default="1,8,32,64", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama", action="store_true", help="leave llama-lookup out")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each method per cell, in alternating order")
    parser.add_argument("--quick", action="store_true", help="SmolLM2, B = 1 and 8, fewer tokens, one run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/speculative")
    args = parser.parse_args()
    if args.quick:
        args.models, args.batches, args.repeats = ["smollm2"], [1, 8], 1
        MAX_TOKENS.update({name: 24 for name in MAX_TOKENS})
    torch.set_num_threads(args.threads)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps(results, indent=1))
    (args.out / "speculative.md").write_text(markdown(results))
    plot(results, args.out / "speculative.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
