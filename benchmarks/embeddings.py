"""tokenmill's embedding path against what users run today, on the same texts, measured in one run.

    python benchmarks/embeddings.py                  # 20,000 texts, 3 rounds, 2 threads, with the sweeps
    python benchmarks/embeddings.py --texts 5000 --rounds 2 --threads 4
    python benchmarks/embeddings.py --quick          # 200 texts, 1 round, no sweeps: a smoke run, numbers mean nothing

The workload: N texts of 10-250 tokens (as all-MiniLM-L6-v2's tokenizer counts them, [CLS] and
[SEP] included), lengths drawn from a lognormal (median near 27, a long tail capped at 250, redrawn
under 10) from --seed, each a window of real English from benchmarks/corpus.txt cut to its length
on word boundaries. They are written as a text file (one document a line) and as an OpenAI batch
JSONL of /v1/embeddings rows in a temporary folder.

The contenders, each embedding every text end to end (tokenizing included, loading not: except
the job, which a user pays for with every run), on --threads threads:
  sentence-transformers b32   SentenceTransformer(folder).encode(texts, batch_size=32), its default
  sentence-transformers bB    the same at the batch size that won a sweep on --sweep-texts texts
  onnxruntime fp32            the BertModel exported with torch.onnx.export; the fast tokenizer, sorted
                              by token length, longest first, batches of 32 padded to their longest (as
                              sentence-transformers batches), mean pooling and normalising in numpy
  onnxruntime int8            the same on quantize_dynamic(QInt8 weights) of that export
  tokenmill Embedder          Embedder().embed(texts) in this process, default settings (fp32)
  tokenmill Embedder q8       the same with weight_format="q8" (linear layers on the 8-bit GEMM)
  tokenmill run --embed       `tokenmill run TEXTS.txt -o OUT --embed --overwrite --num-threads T` as a
                              subprocess, start to exit: the job layer's cost; summary.json's figures too
  llama.cpp llama-embedding   the model converted to an f32 GGUF by llama.cpp's converter, the text file
                              in one run, start to exit (where benchmarks/setup_llamacpp.sh built it)
One at a time, in --rounds rounds, the order rotated each round so that drift hits all of them; the
table holds the medians of the rounds, and ratios are the medians of each round's ratios (to
sentence-transformers b32 and to onnxruntime fp32 measured in the same round). Cosines: each row's
vector against sentence-transformers b32's (all normalised), min and mean. Before the rounds, a sweep
of max_num_batched_tokens for the Embedder, measured once each on the sweep subset.
Every number carries the CPU seconds other processes used meanwhile (a busy machine ruins CPU
benchmarks). Writes embeddings.{json,md,png} to --out (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Beside this file, on the path when it runs as a script: the other processes' CPU, per process.
from structured import busiest, busiest_now, process_cpu_seconds

from tokenmill.bench.runner import CpuMeter, environment
from tokenmill.embed.embedder import Embedder
from tokenmill.environment import DEFAULT_EMBEDDING_MODEL

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
TOKENMILL = Path(sys.executable).parent / "tokenmill"  # the console script beside this Python, as users run it
MIN_TOKENS, MAX_TOKENS = 10, 250
MEDIAN_TOKENS, SIGMA = 26, 0.8  # the lognormal's; redrawing under MIN_TOKENS lifts the median a little
ST_DEFAULT_BATCH = 32
ST_BATCHES, BUDGETS = (16, 32, 64, 128), (512, 1024, 2048, 4096)
WARM_TEXTS = 64
# llama-embedding's batch (-b, -ub and the context alike): it attends over a whole micro-batch under a
# mask, so larger ones cost more (docs/embeddings.md); 512 holds the longest input of the workload.
LLAMA_BATCH = ("-b", "512", "-ub", "512", "-c", "512")
LLAMA_CPP = Path(__file__).resolve().parents[1] / "build" / "llamacpp" / "src" / "vendor" / "llama.cpp"
ST_BASELINE, ORT_BASELINE = "sentence-transformers b32", "onnxruntime fp32"
Vectors = np.ndarray


# ---- the workload -----------------------------------------------------------------------------------
@dataclass
class Workload:
    texts: list[str]
    lengths: list[int]  # tokens per text, special tokens included
    text_file: Path
    jsonl_file: Path

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def stats(self) -> dict[str, Any]:
        p = [float(v) for v in np.percentile(self.lengths, [10, 50, 90, 99])]
        return {"texts": len(self.texts), "tokens": self.tokens, "mean_tokens": round(self.tokens / len(self.texts), 1),
                "p10": p[0], "median": p[1], "p90": p[2], "p99": p[3], "min": min(self.lengths),
                "max": max(self.lengths), "text_file": str(self.text_file), "jsonl_file": str(self.jsonl_file)}


def token_lengths(rng: np.random.Generator, count: int) -> list[int]:
    lengths = rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, count)
    while (short := lengths < MIN_TOKENS).any():
        lengths[short] = rng.lognormal(np.log(MEDIAN_TOKENS), SIGMA, int(short.sum()))
    return np.minimum(lengths, MAX_TOKENS).round().astype(int).tolist()


def window(words: list[str], pieces: dict[str, int], start: int, budget: int) -> str:
    """Words from `start` on (wrapping) while their tokens fit `budget`. BERT's pre-tokenizer splits
    at whitespace before anything else, so a text's tokens are the sum of its words' tokens."""
    taken, total, i = [], 0, start
    while True:
        word = words[i % len(words)]
        i += 1
        if total + pieces[word] <= budget:
            taken.append(word)
            total += pieces[word]
        elif total >= MIN_TOKENS - 2:
            return " ".join(taken)
        # else: a word too long for a short text (a URL): skip it rather than end under MIN_TOKENS


def build_texts(tokenizer: Any, count: int, seed: int) -> list[str]:
    words = CORPUS.read_text().split()
    distinct = sorted(set(words))
    pieces = dict(zip(distinct, map(len, tokenizer(distinct, add_special_tokens=False)["input_ids"]), strict=True))
    rng = np.random.default_rng(seed)
    targets = token_lengths(rng, count)
    starts = rng.integers(len(words), size=count)
    return [window(words, pieces, int(s), t - 2) for s, t in zip(starts, targets, strict=True)]  # [CLS], [SEP]


def write_workload(tokenizer: Any, texts: list[str], folder: Path) -> Workload:
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    bad = [n for n in lengths if not MIN_TOKENS <= n <= MAX_TOKENS]
    if bad:
        raise RuntimeError(f"{len(bad)} texts outside {MIN_TOKENS}-{MAX_TOKENS} tokens, e.g. {bad[:5]}")
    text_file, jsonl_file = folder / "texts.txt", folder / "texts.jsonl"
    text_file.write_text("".join(t + "\n" for t in texts))
    rows = ({"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": DEFAULT_EMBEDDING_MODEL, "input": t}} for i, t in enumerate(texts))
    jsonl_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return Workload(texts, lengths, text_file, jsonl_file)


# ---- contenders ---------------------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    embed: Callable[[], Any]  # the timed part: the whole workload, end to end
    vectors: Callable[[Any], Vectors] = lambda output: output  # its output as [N, dim] (not timed)
    details: Callable[[Any], dict[str, Any]] = lambda output: {}
    warm_up: Callable[[], Any] = lambda: None


def in_process(name: str, embed: Callable[[list[str]], Vectors], texts: list[str]) -> Contender:
    return Contender(name, lambda: embed(texts), warm_up=lambda: embed(texts[:WARM_TEXTS]))


def st_contender(model: Any, batch_size: int, texts: list[str]) -> Contender:
    def encode(some: list[str]) -> Vectors:
        return model.encode(some, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True)

    return in_process(f"sentence-transformers b{batch_size}", encode, texts)


class OrtEmbedder:
    """An ONNX BertModel as sentence-transformers runs one: batches of length-sorted texts padded to
    their longest, mean pooling over the attention mask, normalised."""

    def __init__(self, path: Path, tokenizer: Any, threads: int, max_length: int, batch_size: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.tokenizer, self.max_length, self.batch_size = tokenizer, max_length, batch_size

    def embed(self, texts: list[str]) -> Vectors:
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        out: Vectors | None = None
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            pooled = self._forward([ids[i] for i in batch])
            out = np.empty((len(texts), pooled.shape[1]), np.float32) if out is None else out
            out[batch] = pooled
        assert out is not None
        return out

    def _forward(self, rows: list[list[int]]) -> Vectors:
        longest = max(map(len, rows))
        input_ids = np.full((len(rows), longest), self.tokenizer.pad_token_id, np.int64)
        mask = np.zeros((len(rows), longest), np.int64)
        for r, seq in enumerate(rows):
            input_ids[r, : len(seq)], mask[r, : len(seq)] = seq, 1
        hidden = self.session.run(["last_hidden_state"], {"input_ids": input_ids, "attention_mask": mask,
                                                          "token_type_ids": np.zeros_like(mask)})[0]
        summed = (hidden * mask[:, :, None]).sum(axis=1)
        return normalised(summed / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9))


class _LastHidden(torch.nn.Module):
    """BertModel with keyword inputs and one output: its positional signature is not the exporter's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
                ) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          token_type_ids=token_type_ids).last_hidden_state


def export_onnx(folder: Path, tokenizer: Any, out: Path) -> dict[str, Any]:
    """fp32 and int8 (dynamic, QInt8 weights) ONNX files of the model in `folder`, in `out`."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel

    start = time.perf_counter()
    # A fresh eager model: SDPA's mask code traces into shape-specific branches.
    model = AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    sample = tokenizer(["a short one", "a somewhat longer sample sentence for tracing"], padding=True,
                       return_tensors="pt")
    axes = {0: "batch", 1: "sequence"}
    names = ["input_ids", "attention_mask", "token_type_ids"]
    fp32, int8 = out / "model.onnx", out / "model-int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings on transformers' shape checks
        torch.onnx.export(_LastHidden(model), tuple(sample[n] for n in names), str(fp32), input_names=names,
                          output_names=["last_hidden_state"],
                          dynamic_axes={n: axes for n in [*names, "last_hidden_state"]}, opset_version=17,
                          dynamo=False)
    exported = time.perf_counter()
    quantize_dynamic(str(fp32), str(int8), weight_type=QuantType.QInt8)
    return {"fp32": fp32, "int8": int8, "export_s": round(exported - start, 1),
            "quantize_s": round(time.perf_counter() - exported, 1),
            "fp32_mb": round(fp32.stat().st_size / 1e6, 1), "int8_mb": round(int8.stat().st_size / 1e6, 1)}


def cli_contender(workload: Workload, threads: int, folder: Path) -> Contender:
    out = folder / "job"

    def run_job(input_file: Path) -> Path:
        command = [str(TOKENMILL), "run", str(input_file), "-o", str(out), "--embed", "--overwrite",
                   "--num-threads", str(threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return out

    def warm_up() -> None:
        # A first run ever may compile and cache what later runs reuse; a user pays that once.
        small = folder / "warm.txt"
        small.write_text("".join(t + "\n" for t in workload.texts[:WARM_TEXTS]))
        run_job(small)

    return Contender("tokenmill run --embed", lambda: run_job(workload.text_file),
                     vectors=lambda job: job_vectors(job, len(workload.texts)), details=job_summary,
                     warm_up=warm_up)


def job_vectors(job: Path, count: int) -> Vectors:
    """The job's vectors in input order: a text file's row `line-K` is its K-th line."""
    out: Vectors | None = None
    with open(job / "results.jsonl") as f:
        for line in f:
            row = json.loads(line)
            vector = row["response"]["body"]["data"][0]["embedding"]
            out = np.empty((count, len(vector)), np.float32) if out is None else out
            out[int(row["custom_id"].removeprefix("line-")) - 1] = vector
    assert out is not None
    return out


def job_summary(job: Path) -> dict[str, Any]:
    s = json.loads((job / "summary.json").read_text())
    return {"load_s": s["time"]["load_s"], "job_wall_s": s["time"]["wall_s"],
            "input_tok_s": s["throughput"]["input_tok_s"], "vectors_per_s": s["throughput"]["vectors_per_s"],
            "prompt_tokens": s["tokens"]["prompt"], "forward_s": s["engine"]["prefill_s"],
            "done": s["requests"]["done"], "failed": s["requests"]["failed"]}


def llama_cpp_contender(workload: Workload, threads: int, model_folder: Path) -> Contender | None:
    """llama.cpp's `llama-embedding` on the model converted to an f32 GGUF by its own converter,
    every text of the file in one run (mean pooling, normalised), start to exit as a user runs it.
    None where benchmarks/setup_llamacpp.sh has not built it."""
    if not (LLAMA_CPP / "build" / "bin" / "llama-embedding").is_file():
        return None
    gguf = LLAMA_CPP.parents[3] / "all-minilm-l6-v2-f32.gguf"  # beside the build, made once
    if not gguf.is_file():
        env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}
        subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(model_folder), "--outfile",
                        str(gguf), "--outtype", "f32"], check=True, capture_output=True, env=env)

    def embed(text_file: Path) -> str:
        command = [str(LLAMA_CPP / "build" / "bin" / "llama-embedding"), "-m", str(gguf), "-f", str(text_file),
                   "--pooling", "mean", "--embd-normalize", "2", "--embd-output-format", "array",
                   "-t", str(threads), *LLAMA_BATCH]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout

    def warm_up() -> None:
        small = workload.text_file.with_name("warm-llama.txt")
        small.write_text("".join(t + "\n" for t in workload.texts[:WARM_TEXTS]))
        embed(small)

    return Contender("llama.cpp llama-embedding", lambda: embed(workload.text_file),
                     vectors=lambda out: np.array(json.loads(out[out.index("[["):]), dtype=np.float32),
                     warm_up=warm_up)


def q8_contender(threads: int, texts: list[str]) -> Contender:
    embedder = Embedder(num_threads=threads, weight_format="q8")
    return in_process("tokenmill Embedder q8", embedder.embed, texts)


# ---- measuring ------------------------------------------------------------------------------------------
@dataclass
class Measurement:
    name: str
    round: int  # 0 for a sweep
    texts: int
    tokens: int
    wall_s: float
    other_cpu_s: float
    busiest_others: list[dict[str, Any]]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def texts_s(self) -> float:
        return self.texts / self.wall_s

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def line(self) -> str:
        top = f", most by {self.busiest_others[0]['cmd']!r}" if self.busiest_others else ""
        where = f"round {self.round}" if self.round else "sweep"
        return (f"  {where:8s} {self.name:28s} {self.texts_s:9.1f} texts/s {self.tok_s:10.0f} tok/s  "
                f"wall {self.wall_s:7.2f} s  [other CPU {self.other_cpu_s:.2f} s{top}]")


def normalised(vectors: Vectors) -> Vectors:
    vectors = np.asarray(vectors, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def measure(contender: Contender, round_: int, texts: int, tokens: int) -> tuple[Measurement, Vectors]:
    processes, meter = process_cpu_seconds(), CpuMeter()
    start = time.perf_counter()
    output = contender.embed()
    wall = time.perf_counter() - start
    other = meter.other_seconds()  # this process's children (the job) count as its own
    if other is None:
        raise OSError("no /proc/stat: cannot report other processes' CPU use, so no honest number")
    result = Measurement(contender.name, round_, texts, tokens, wall, other, busiest(processes),
                         contender.details(output))
    print(result.line(), flush=True)
    vectors = normalised(contender.vectors(output))
    if vectors.shape[0] != texts:
        raise RuntimeError(f"{contender.name}: {vectors.shape[0]} vectors for {texts} texts")
    return result, vectors


def sweep(contenders: list[Contender], texts: int, tokens: int) -> list[Measurement]:
    """Each contender once, after its warm-up, on the sweep subset."""
    done = []
    for c in contenders:
        c.warm_up()
        done.append(measure(c, 0, texts, tokens)[0])
    return done


def rounds(contenders: list[Contender], count: int, workload: Workload
           ) -> tuple[list[list[Measurement]], dict[str, Vectors]]:
    """Every contender once a round, the order rotated each round; the first vectors of each."""
    results: list[list[Measurement]] = []
    vectors: dict[str, Vectors] = {}
    for r in range(count):
        shift = r % len(contenders)
        measured = []
        for c in contenders[shift:] + contenders[:shift]:
            m, v = measure(c, r + 1, len(workload.texts), workload.tokens)
            measured.append(m)
            vectors.setdefault(c.name, v)
        results.append(measured)
    return results, vectors


def table(all_rounds: list[list[Measurement]], vectors: dict[str, Vectors]) -> list[dict[str, Any]]:
    """Per contender: medians over the rounds, medians of each round's ratios to the two baselines,
    cosines to sentence-transformers b32, and the other processes' CPU seconds of each round."""
    reference = vectors[ST_BASELINE]
    rows = []
    for name in vectors:
        mine = [next(m for m in measured if m.name == name) for measured in all_rounds]
        base = {b: [next(m for m in measured if m.name == b).tok_s for measured in all_rounds]
                for b in (ST_BASELINE, ORT_BASELINE)}
        cosines = (vectors[name] * reference).sum(axis=1)
        rows.append({
            "name": name, "texts_s": statistics.median(m.texts_s for m in mine),
            "tok_s": statistics.median(m.tok_s for m in mine),
            "vs_st_b32": statistics.median(m.tok_s / b for m, b in zip(mine, base[ST_BASELINE], strict=True)),
            "vs_ort_fp32": statistics.median(m.tok_s / b for m, b in zip(mine, base[ORT_BASELINE], strict=True)),
            "cos_min": float(cosines.min()), "cos_mean": float(cosines.mean()),
            "other_cpu_s": [m.other_cpu_s for m in mine], "rounds": len(mine),
            "details": [m.details for m in mine if m.details]})
    return rows


# ---- report -------------------------------------------------------------------------------------------------
def print_table(rows: list[dict[str, Any]]) -> None:
    print("\nmedians of the rounds (ratios: medians of each round's ratio); cosine to sentence-transformers b32")
    print(f"{'contender':28s} {'texts/s':>9s} {'tok/s':>9s} {'×ST b32':>8s} {'×ORT fp32':>9s} "
          f"{'cos min':>8s} {'cos mean':>9s}  other CPU s (each round)")
    for r in rows:
        print(f"{r['name']:28s} {r['texts_s']:9.1f} {r['tok_s']:9.0f} {r['vs_st_b32']:7.2f}× {r['vs_ort_fp32']:8.2f}× "
              f"{r['cos_min']:8.5f} {r['cos_mean']:9.6f}  {' / '.join(f'{s:.2f}' for s in r['other_cpu_s'])}")


def markdown(report: dict[str, Any]) -> str:
    w, env = report["workload"], report["environment"]
    lines = [f"`{report['command']}`" + (" — QUICK smoke run: the numbers mean nothing" if report["quick"] else ""),
             "", f"{w['texts']} texts, {w['tokens']} tokens (special tokens included; mean {w['mean_tokens']}, "
             f"median {w['median']:.0f}, p90 {w['p90']:.0f}, p99 {w['p99']:.0f}, {w['min']}-{w['max']}), "
             f"{report['threads']} threads, {report['rounds']} round(s), {env['cpu_count']} CPUs ({env['cpu']}); "
             f"torch {env['torch']}, sentence-transformers {report['versions']['sentence-transformers']}, "
             f"onnxruntime {report['versions']['onnxruntime']}.", "",
             "| contender | texts/s | tok/s | × ST b32 | × ORT fp32 | cos min | cos mean | other CPU s (each round) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["table"]:
        other = " / ".join(f"{s:.2f}" for s in r["other_cpu_s"])
        lines.append(f"| {r['name']} | {r['texts_s']:.1f} | {r['tok_s']:.0f} | {r['vs_st_b32']:.2f}× | "
                     f"{r['vs_ort_fp32']:.2f}× | {r['cos_min']:.5f} | {r['cos_mean']:.6f} | {other} |")
    lines += ["", "Medians of the rounds; ratios are medians of each round's ratio to the baseline measured in that "
              "round. Cosines: each text's vector against sentence-transformers b32's, all normalised.", ""]
    for d in next((r["details"] for r in report["table"] if r["name"] == "tokenmill run --embed"), []):
        lines.append(f"- tokenmill run, its summary.json: model load {d['load_s']} s, job wall {d['job_wall_s']} s, "
                     f"{d['input_tok_s']} input tok/s, {d['vectors_per_s']} vectors/s, in forwards {d['forward_s']} s, "
                     f"{d['prompt_tokens']} prompt tokens, {d['done']} done, {d['failed']} failed")
    lines += sweep_markdown(report)
    o = report["onnx"]
    lines += ["", f"ONNX: exported in {o['export_s']} s ({o['fp32_mb']} MB), quantized in {o['quantize_s']} s "
              f"({o['int8_mb']} MB); ORT batches of {report['ort_batch']}, no transformer graph fusion "
              "(onnxruntime.transformers.optimizer) applied.", ""]
    lines += [f"Not measured: {note}" for note in report["not_measured"]]
    lines += ["", "Other processes (cores in use over 1 s):", ""]
    for when in ("start", "end"):
        p = report["other_processes"][when]
        top = "; ".join(f"{b['cpu_s']:.2f} {b['cmd']}" for b in p["busiest"]) or "none"
        lines.append(f"- at {when}: {p['other_cores_in_use']:.2f} cores — {top}")
    return "\n".join(lines) + "\n"


def sweep_markdown(report: dict[str, Any]) -> list[str]:
    if not report["sweeps"]:
        return ["", "No sweeps (--quick)."]
    lines = ["", f"Sweeps, once each on the first {report['sweep_texts']} texts (after a warm-up); "
             f"sentence-transformers' best batch size: {report['st_best_batch']}.", "",
             "| sweep | texts/s | tok/s | other CPU s |", "|---|---|---|---|"]
    for m in report["sweeps"]:
        lines.append(f"| {m['name']} | {m['texts_s']:.1f} | {m['tok_s']:.0f} | {m['other_cpu_s']:.2f} |")
    return lines


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    rows = report["table"]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.6))
    values = [r["tok_s"] for r in rows]
    ax.barh([r["name"] for r in rows], values, color="tab:blue")
    for y, r in enumerate(rows):
        ax.annotate(f" {r['tok_s']:.0f}: {r['vs_st_b32']:.2f}× ST b32, {r['vs_ort_fp32']:.2f}× ORT fp32",
                    (r["tok_s"], y), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.6 * max(values))
    ax.set_xlabel(f"tokens/s end to end (median of {report['rounds']} round(s)), {report['threads']} threads")
    ax.set_title(report["command"] + (" (QUICK smoke run)" if report["quick"] else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main ---------------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch, onnxruntime, tokenizers and the job's")
    ap.add_argument("--sweep-texts", type=int, default=4000, help="the subset the sweeps run on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="200 texts, 1 round, no sweeps: a smoke run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if args.quick:
        args.texts, args.rounds = 200, 1
    args.sweep_texts = min(args.sweep_texts, args.texts)
    return args


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    # The fast tokenizers' batch calls run on rayon's pool (all cores unless told); the job inherits it.
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def run_sweeps(args: argparse.Namespace, st_model: Any, texts: list[str], lengths: list[int]
               ) -> tuple[list[Measurement], int]:
    """sentence-transformers' batch sizes and the Embedder's budgets on the subset; the best batch."""
    subset, tokens = texts[: args.sweep_texts], sum(lengths[: args.sweep_texts])
    print(f"sweeps on {len(subset)} texts:", flush=True)
    st = sweep([st_contender(st_model, b, subset) for b in ST_BATCHES], len(subset), tokens)
    best = ST_BATCHES[max(range(len(st)), key=lambda i: st[i].tok_s)]
    budgets = []
    for budget in BUDGETS:
        embedder = Embedder(max_num_batched_tokens=budget, num_threads=args.threads)
        budgets += sweep([in_process(f"tokenmill budget {budget}", embedder.embed, subset)], len(subset), tokens)
    print(f"  sentence-transformers' best batch size: {best}", flush=True)
    return st + budgets, best


def main() -> None:
    args = parse_args()
    set_threads(args.threads)
    command = shlex.join(["python", "benchmarks/embeddings.py", *sys.argv[1:]])
    print(command, f"\n{args.threads} threads, {os.cpu_count()} CPUs", flush=True)
    at_start = busiest_now()
    print(f"other processes at start: {at_start}", flush=True)
    from sentence_transformers import SentenceTransformer

    embedder = Embedder(num_threads=args.threads)
    tokenizer = embedder.tokenizer
    st_model = SentenceTransformer(str(embedder.folder), device="cpu")
    with tempfile.TemporaryDirectory(prefix="embeddings-bench-") as tmp:
        folder = Path(tmp)
        workload = write_workload(tokenizer, build_texts(tokenizer, args.texts, args.seed), folder)
        print(f"workload: {workload.stats()}", flush=True)
        onnx = export_onnx(embedder.folder, tokenizer, folder)
        print(f"onnx: {onnx}", flush=True)
        sweeps, best = ([], None) if args.quick else run_sweeps(args, st_model, workload.texts, workload.lengths)

        texts = workload.texts
        ort = {kind: OrtEmbedder(onnx[kind], tokenizer, args.threads, embedder.max_model_len, ST_DEFAULT_BATCH)
               for kind in ("fp32", "int8")}
        contenders = [st_contender(st_model, ST_DEFAULT_BATCH, texts)]
        if best is not None and best != ST_DEFAULT_BATCH:
            contenders.append(st_contender(st_model, best, texts))
        contenders += [in_process(ORT_BASELINE, ort["fp32"].embed, texts),
                       in_process("onnxruntime int8", ort["int8"].embed, texts),
                       in_process("tokenmill Embedder", embedder.embed, texts),
                       q8_contender(args.threads, texts),
                       cli_contender(workload, args.threads, folder)]
        llama = llama_cpp_contender(workload, args.threads, embedder.folder)
        not_measured = [] if llama else ["llama.cpp `llama-embedding` (not built: bash benchmarks/setup_llamacpp.sh)"]
        contenders += [llama] if llama else []
        print("warm-ups, then the rounds:", flush=True)
        for c in contenders:
            c.warm_up()
        all_rounds, vectors = rounds(contenders, args.rounds, workload)
        rows = table(all_rounds, vectors)
        report = {
            "command": command, "quick": args.quick, "threads": args.threads, "rounds": args.rounds,
            "seed": args.seed, "environment": environment(), "loadavg_at_end": os.getloadavg(),
            "versions": {p: version(p) for p in ("sentence-transformers", "onnxruntime", "onnx", "transformers")},
            "workload": workload.stats() | {"files": "in a temporary folder, removed at the end"},
            "onnx": {k: str(v) if isinstance(v, Path) else v for k, v in onnx.items()},
            "ort_batch": ST_DEFAULT_BATCH, "table": rows, "sweep_texts": args.sweep_texts, "st_best_batch": best,
            "sweeps": [asdict(m) | {"texts_s": m.texts_s, "tok_s": m.tok_s} for m in sweeps],
            "measurements": [asdict(m) | {"texts_s": m.texts_s, "tok_s": m.tok_s} for ms in all_rounds for m in ms],
            "not_measured": not_measured, "other_processes": {"start": at_start, "end": busiest_now()},
        }
    print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "embeddings.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "embeddings.md").write_text(markdown(report))
    plot(report, args.out / "embeddings.png")
    print("\n" + "\n".join(f"not measured: {n}" for n in not_measured))
    print(f"wrote {args.out / 'embeddings.json'}, .md and .png")


if __name__ == "__main__":
    main()
