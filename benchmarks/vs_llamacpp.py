"""tokenmill against llama.cpp's `llama-batched-bench` on the same GGUF files, same shapes, same
threads, measured in alternating rounds in one run; perplexity beside it from `llama-perplexity`,
the engine scored on llama.cpp's own tokens of the text (`llama-tokenize`): the same windows.

    python benchmarks/vs_llamacpp.py                                  # both models, both shapes
    python benchmarks/vs_llamacpp.py --models smollm2 --shapes 256x64 --batches 1,32 --rounds 1
    python benchmarks/vs_llamacpp.py --threads 1,2 --shapes 256x64 --batches 32   # thread scaling
    python benchmarks/vs_llamacpp.py --models set,smollm2 --shapes 256x64 --batches 1,8   # the model set too
    python benchmarks/vs_llamacpp.py --models qwen3-1.7b-Q4_K_M,llama-1.1b-Q8_0,path/to/model.gguf

--models takes the two real models by name (smollm2, gemma3-270m), the files of the benchmark set
of real shapes with random weights by name (NAME-QUANT, as `python benchmarks/model_set.py --list`
prints them; `set` for all of them that are built; benchmarks/model_set.py builds them), and GGUF
paths.

A shape PPxTG is B prompts of PP random tokens, each generating TG tokens with EOS ignored, prefix
caching off. llama-batched-bench prefills all B prompts, then decodes B sequences TG times; the
engine gets all B requests at once with max_num_seqs = B and schedules them its own way (chunked
prefill beside decodes). The figure compared is the one a batch job pays for: output tokens per
second end to end, B·TG / the whole run's wall time. Prefill and decode are also printed apart:
llama.cpp's own T_PP and T_TG; the engine's prefill is until the last request's first token.

Each round runs llama.cpp then tokenmill for every (model, shape, batch), so a ratio compares the
two under the same conditions (this machine's speed drifts); the table is the median of the rounds'
ratios. Every figure carries the CPU seconds other processes used meanwhile, and the memory read
rate measured just before it (a 256 MiB sum on the same threads, on huge pages as the engine's
weights are): a decode step reads every weight, so at batch 1 that rate over the engine's weight
bytes is the decode ceiling of that moment, printed beside the engine's batch-1 decode. Those bytes
are printed for each model beside llama.cpp's for the same file (its tensors, less the embedding
table unless that is the output layer too), and kept in the results. llama.cpp comes from
`bash benchmarks/setup_llamacpp.sh`.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# Beside this file, on the path when it runs as a script: the benchmark set's names and files.
from model_set import BUILD_COMMAND, SET_DIR, set_files

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter, environment
from tokenmill.engine.perplexity import perplexity, perplexity_of_tokens
from tokenmill.environment import NAMED_MODELS, named_model_path
from tokenmill.formats.gguf_config import ROPE_FREQS
from tokenmill.formats.gguf_header import read_gguf_header
from tokenmill.models.huge_pages import huge_page_empty

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "corpus.txt"
BIN = ROOT / "build" / "llamacpp" / "src" / "vendor" / "llama.cpp" / "build" / "bin"
PLOT_COLUMNS = 3  # models across a figure before it wraps
PERPLEXITY_WINDOW, PERPLEXITY_WINDOWS = 512, 36


@dataclass
class Cell:
    model: str
    shape: str
    batch: int
    threads: int
    engine: str
    out_tok_s: float  # B·TG / whole wall time
    prefill_tok_s: float
    decode_tok_s: float
    wall_s: float
    other_cpu_s: float | None
    read_gb_s: float  # memory read rate just before the cell
    decode_ceiling_tok_s: float | None = None  # batch 1: read rate / the engine's weight bytes


@functools.cache
def _read_buffer() -> torch.Tensor:
    # 256 MiB, far past the last-level cache, on the huge pages the engine keeps its weights on
    return huge_page_empty((64 * 2**20,), torch.float32).fill_(1.0)


def read_rate_gb_s() -> float:
    """Best of three sums over 256 MiB of fp32 on torch's threads: what the weight streams can get."""
    x = _read_buffer()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a decode step reads: all but the embedding table (one row a token) unless
    it is the lm_head too, counted once; not the RoPE tables."""
    model, seen, total = llm.engine.runner.model, set(), 0
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if "rope" not in name and "embed_tokens" not in name and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def llama_cpp_weight_bytes(path: Path) -> int:
    """Bytes of the tensors llama.cpp reads in a batch-1 decode step of this GGUF: all of them but
    the token embedding table (a row a token), unless there is no output tensor and it is the output
    layer too; not the RoPE frequency factors, as weight_bytes leaves out the engine's RoPE tables."""
    tensors = read_gguf_header(path).tensors
    tied = "output.weight" not in tensors
    return sum(info.n_bytes for name, info in tensors.items()
               if name != ROPE_FREQS and (tied or name != "token_embd.weight"))


def model_paths(names: list[str]) -> dict[str, Path]:
    """--models as {name: GGUF}: a real model by name, a file of the benchmark set by name (`set`:
    all of them that are built), or a path; SystemExit for a set file not built, naming the command."""
    paths: dict[str, Path] = {}
    files = set_files()
    for name in names:
        if name == "set":
            built = {model: f.path for model, f in files.items() if f.path.is_file()}
            if not built:
                raise SystemExit(f"no file of the benchmark set in {SET_DIR}: build them with `{BUILD_COMMAND}`")
            paths |= built
        elif name in NAMED_MODELS:
            paths[name] = named_model_path(name)
        elif name in files:
            if not files[name].path.is_file():
                raise SystemExit(f"{files[name].path}: not built; build it with `{files[name].build_command}`")
            paths[name] = files[name].path
        elif Path(name).is_file():
            paths[Path(name).stem] = Path(name)
        else:
            raise SystemExit(f"--models {name}: no such file, and not a model name (known: "
                             f"{', '.join([*NAMED_MODELS, 'set', *files])})")
    return paths


def _shape(text: str) -> tuple[int, int]:
    pp, tg = text.lower().split("x")
    return int(pp), int(tg)


# ---- llama.cpp ------------------------------------------------------------------------------------
def llama_batched_bench(model: str, path: Path, shape: str, batches: list[int], threads: int) -> list[Cell]:
    pp, tg = _shape(shape)
    read = read_rate_gb_s()
    meter = CpuMeter()
    out = subprocess.run(
        [str(BIN / "llama-batched-bench"), "-m", str(path), "-c", str(max(batches) * (pp + tg)), "-b", "2048",
         "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, batches)), "-t", str(threads),
         "--output-format", "jsonl"],
        check=True, capture_output=True, text=True).stdout
    other = meter.other_seconds()  # one figure for the whole process: its batches run back to back
    cells = []
    for line in out.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            b = row["pl"]
            cells.append(Cell(model, shape, b, threads, "llama.cpp", b * tg / row["t"], row["speed_pp"],
                              row["speed_tg"], row["t"], other, read))
    return cells


def llama_perplexity(path: Path, threads: int) -> float:
    out = subprocess.run(
        [str(BIN / "llama-perplexity"), "-m", str(path), "-f", str(CORPUS), "-c", str(PERPLEXITY_WINDOW),
         "--chunks", str(PERPLEXITY_WINDOWS), "-t", str(threads)],
        check=True, capture_output=True, text=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not match:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{out.stderr[-2000:]}")
    return float(match.group(1))


# ---- tokenmill ------------------------------------------------------------------------------------
def load(path: Path, threads: int) -> LLM:
    llm = LLM(str(path), enable_prefix_caching=False, num_threads=threads, max_num_seqs=64)
    # Warm-up at a real shape (first-touch of the KV cache and scratch buffers; llama-batched-bench
    # warms up too): a first 256-token request measured 50 out tok/s, the next ones 60-66.
    warm = [{"prompt_token_ids": [1000 + i] * 256} for i in range(8)]
    llm.generate(warm, SamplingParams(max_tokens=16, min_tokens=16, ignore_eos=True), progress=False)
    return llm


def tokenmill_cell(llm: LLM, model: str, shape: str, batch: int, threads: int, rng: random.Random) -> Cell:
    pp, tg = _shape(shape)
    vocab = llm.engine.runner.model.config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(1000, vocab - 1000) for _ in range(pp)]} for _ in range(batch)]
    params = SamplingParams(max_tokens=tg, min_tokens=tg, temperature=0, ignore_eos=True)
    llm.engine.set_max_num_seqs(batch)
    read = read_rate_gb_s()
    meter, t0 = CpuMeter(), time.monotonic()
    outputs = llm.generate(prompts, params, progress=False)
    wall = time.monotonic() - t0
    assert all(len(o.token_ids) == tg for o in outputs)
    first = max(o.timings.first_token or t0 for o in outputs) - t0
    ceiling = read * 1e9 / weight_bytes(llm) if batch == 1 else None
    return Cell(model, shape, batch, threads, "tokenmill", batch * tg / wall, batch * pp / first,
                batch * (tg - 1) / max(wall - first, 1e-9), wall, meter.other_seconds(), read, ceiling)


# ---- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    paths = model_paths(args.models)
    decode_bytes: dict[str, dict[str, int]] = {}  # per model: what a batch-1 decode step reads, each engine
    rounds: list[list[Cell]] = []
    for r in range(args.rounds):
        cells: list[Cell] = []
        for threads in args.threads:
            for model, path in paths.items():
                llm = load(path, threads)
                if model not in decode_bytes:
                    decode_bytes[model] = {"tokenmill": weight_bytes(llm), "llama.cpp": llama_cpp_weight_bytes(path)}
                    _print_decode_bytes(model, decode_bytes[model])
                for shape in args.shapes:
                    cells += llama_batched_bench(model, path, shape, args.batches, threads)
                    cells += [tokenmill_cell(llm, model, shape, b, threads, rng) for b in args.batches]
                    _print_round(r, [c for c in cells if (c.model, c.shape, c.threads) == (model, shape, threads)])
                del llm
        rounds.append(cells)
    table = _ratios(rounds)
    results: dict = {"environment": environment(), "rounds": [[asdict(c) for c in cells] for cells in rounds],
                     "table": table, "decode_bytes": decode_bytes}
    if args.perplexity:
        results["perplexity"] = {model: _perplexities(path, max(args.threads)) for model, path in paths.items()}
    _print_table(table, results.get("perplexity", {}))
    for model, both in decode_bytes.items():
        _print_decode_bytes(model, both)
    return results


def llama_tokens(path: Path) -> list[int]:
    """The corpus as llama.cpp tokenizes it: its pre-tokenizer splits some whitespace runs otherwise
    than the model's own tokenizer (SmolLM2: from token 795 on, 19,387 tokens against 19,478), so
    the same text would be different windows."""
    out = subprocess.run([str(BIN / "llama-tokenize"), "-m", str(path), "-f", str(CORPUS), "--ids", "--log-disable"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _perplexities(path: Path, threads: int) -> dict:
    """Both engines on the same token windows (llama.cpp's tokens), and tokenmill's own tokenization."""
    theirs = llama_perplexity(path, threads)
    llm = LLM(str(path), num_threads=threads)
    ids = llama_tokens(path)
    bos = ids[0] if ids[0] == getattr(llm.engine.tokenizer, "bos_token_id", None) else None  # as llama-perplexity
    same = perplexity_of_tokens(llm.engine, ids, bos, PERPLEXITY_WINDOW, PERPLEXITY_WINDOWS).value
    own = perplexity(llm.engine, CORPUS.read_text(), window=PERPLEXITY_WINDOW, max_windows=PERPLEXITY_WINDOWS).value
    return {"tokenmill": round(same, 4), "llama.cpp": round(theirs, 4), "change": f"{same / theirs - 1:+.2%}",
            "tokenmill, own tokenizer": round(own, 4)}


def _print_decode_bytes(model: str, both: dict[str, int]) -> None:
    print(f"{model}: a batch-1 decode step reads {both['tokenmill'] / 1e6:,.1f} MB of weights in tokenmill, "
          f"{both['llama.cpp'] / 1e6:,.1f} MB in llama.cpp ({both['tokenmill'] / both['llama.cpp']:.2f}x)", flush=True)


def _print_round(r: int, cells: list[Cell]) -> None:
    for c in sorted(cells, key=lambda c: (c.batch, c.engine)):
        print(f"round {r + 1} {c.model:17s} {c.shape:9s} B{c.batch:<3d} t{c.threads} {c.engine:9s} "
              f"out {c.out_tok_s:7.1f} tok/s  prefill {c.prefill_tok_s:7.1f}  decode {c.decode_tok_s:7.1f}  "
              f"wall {c.wall_s:6.1f} s  (other processes: {c.other_cpu_s} CPU-s; memory read {c.read_gb_s:.1f} GB/s"
              + (f": batch-1 decode ceiling {c.decode_ceiling_tok_s:.0f} tok/s)" if c.decode_ceiling_tok_s else ")"),
              flush=True)


def _ratios(rounds: list[list[Cell]]) -> list[dict]:
    """Per (model, shape, threads, batch): medians of each engine's out tok/s and of the rounds' ratios."""
    keyed: dict[tuple, dict[str, list[float]]] = {}
    for cells in rounds:
        by_key = {(c.model, c.shape, c.threads, c.batch, c.engine): c for c in cells}
        for (model, shape, threads, batch, engine), c in by_key.items():
            entry = keyed.setdefault((model, shape, threads, batch), {"tokenmill": [], "llama.cpp": [], "ratio": []})
            entry[engine].append(c.out_tok_s)
            if engine == "tokenmill":
                entry["ratio"].append(c.out_tok_s / by_key[(model, shape, threads, batch, "llama.cpp")].out_tok_s)
    return [{"model": k[0], "shape": k[1], "threads": k[2], "batch": k[3],
             **{name: round(statistics.median(v), 2) for name, v in values.items()}, "rounds": len(values["ratio"])}
            for k, values in keyed.items()]


def _print_table(table: list[dict], ppl: dict) -> None:
    print("\nout tok/s end to end, medians of the rounds (ratio: median of the rounds' tokenmill / llama.cpp)")
    print(f"{'model':17s} {'shape':9s} {'thr':>3s} {'batch':>5s} {'tokenmill':>9s} {'llama.cpp':>9s} {'ratio':>6s}")
    for row in table:
        print(f"{row['model']:17s} {row['shape']:9s} {row['threads']:3d} {row['batch']:5d} {row['tokenmill']:9.1f} "
              f"{row['llama.cpp']:9.1f} {row['ratio']:5.2f}x")
    for model, p in ppl.items():
        print(f"perplexity {model}: tokenmill {p['tokenmill']} vs llama.cpp {p['llama.cpp']} ({p['change']}) on "
              f"llama.cpp's tokens, {PERPLEXITY_WINDOWS} windows of {PERPLEXITY_WINDOW} of {CORPUS.name}; "
              f"tokenmill on its own tokenizer's {p['tokenmill, own tokenizer']}")


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["shape"], r["threads"]) for r in table})
    columns = min(len(groups), PLOT_COLUMNS)
    lines = -(-len(groups) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.5 * columns, 3.6 * lines), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, (model, shape, threads) in zip(axes.flat, groups, strict=False):
        rows = sorted((r for r in table if (r["model"], r["shape"], r["threads"]) == (model, shape, threads)),
                      key=lambda r: r["batch"])
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["tokenmill"] for r in rows], 0.4, label="tokenmill")
        ax.bar([x + 0.2 for x in xs], [r["llama.cpp"] for r in rows], 0.4, label="llama.cpp")
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"{r['ratio']:.2f}x", (x, max(r["tokenmill"], r["llama.cpp"])), ha="center", va="bottom")
        ax.set_xticks(list(xs), [f"B{r['batch']}" for r in rows])
        ax.set_title(f"{model} {shape} ({threads} threads)", fontsize=9)
        ax.set_ylabel("output tok/s, end to end")
        ax.margins(y=0.15)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3-270m", type=lambda s: s.split(","))
    parser.add_argument("--shapes", default="256x64,2048x512", type=lambda s: s.split(","))
    parser.add_argument("--batches", default="1,8,32,64", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--threads", default=str(torch.get_num_threads()),
                        type=lambda s: [int(t) for t in s.split(",")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--perplexity", action="store_true", help="also each model's perplexity, both engines")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="draw the table here (PNG)")
    args = parser.parse_args()
    for tool in ("llama-batched-bench", "llama-perplexity", "llama-tokenize"):
        if not (BIN / tool).is_file():
            raise SystemExit(f"{BIN / tool}: not built; run `bash benchmarks/setup_llamacpp.sh` first")
    results = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results["table"], args.plot)


if __name__ == "__main__":
    main()
