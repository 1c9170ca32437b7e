"""Quantised weights (EngineConfig.weight_format): what they cost in accuracy, what they gain in
speed, and how they compare with llama.cpp on the same GGUF, measured in one run.

    python benchmarks/quant.py accuracy [--windows 12]      # perplexity + greedy agreement vs fp32
    python benchmarks/quant.py kernels                      # GMAC/s per layer shape vs the int8 peak
    python benchmarks/quant.py kernels --shapes set         # the same at benchmarks/model_set.py's shapes
    python benchmarks/quant.py llamacpp [--rounds 3]         # batch 1, llama-bench's pp256/tg64 tests
    python benchmarks/quant.py steady --minutes 30           # one long job: does throughput drift?

llama.cpp comes from `bash benchmarks/setup_llamacpp.sh` (its default build folder is found).
Every timed number is printed with the CPU seconds other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter
from tokenmill.engine import perplexity
from tokenmill.environment import embedded_model_path
from tokenmill.models import kernels as kernels_lib
from tokenmill.models.packed import PackedLinear
from tokenmill.models.quant import SUPER_BLOCK, Quantized, QuantizedLinear, ScaleFormat, SuperBlockValues, quantize
from tokenmill.plan.model_specs import spec_from_hf_config

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "corpus.txt"
LLAMA_BENCH = ROOT / "build" / "llamacpp" / "src" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-bench"
FORMATS = ("fp32", "q8", "auto")


def _other(meter: CpuMeter) -> str:
    return f"(other processes: {meter.other_seconds()} CPU-s)"


def _prompts(tokenizer, n: int, length: int, offset: int = 0) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = tokenizer(CORPUS.read_text(), add_special_tokens=False)["input_ids"]
    step = (len(ids) - length) // (n + offset)
    return [ids[(i + offset) * step : (i + offset) * step + length] for i in range(n)]


# ---- accuracy ---------------------------------------------------------------------------------
def accuracy(args: argparse.Namespace) -> dict:
    text, results, greedy = CORPUS.read_text(), {}, {}
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for fmt in FORMATS:
        llm = LLM(args.model, weight_format=fmt)
        ppl = perplexity(llm.engine, text, window=512, max_windows=args.windows)
        prompts = [{"prompt_token_ids": p} for p in _prompts(llm.tokenizer, 32, 64)]
        greedy[fmt] = [o.token_ids for o in llm.generate(prompts, params, progress=False)]
        results[fmt] = {"perplexity": round(ppl.value, 4), "tokens_scored": ppl.tokens_scored}
        print(f"{fmt:5s} perplexity {ppl.value:.4f} over {ppl.tokens_scored} tokens", flush=True)
    for fmt in FORMATS[1:]:
        same = sum(a == b for a, b in zip(greedy[fmt], greedy["fp32"], strict=True))
        prefix = statistics.mean(_common_prefix(a, b) for a, b in zip(greedy[fmt], greedy["fp32"], strict=True))
        change = results[fmt]["perplexity"] / results["fp32"]["perplexity"] - 1
        results[fmt].update(perplexity_vs_fp32=f"{change:+.2%}", identical_greedy_outputs=f"{same}/32",
                            mean_agreeing_prefix_tokens=round(prefix, 1))
        print(f"{fmt:5s} vs fp32: perplexity {change:+.2%}; greedy 32 tokens identical for {same}/32 prompts, "
              f"first difference after {prefix:.1f} tokens on average")
    return results


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- kernels ----------------------------------------------------------------------------------
# (name, out N, in K, bits): SmolLM2's fused layers, then Gemma 3 270M's as the engine holds them
# (its qkv is 5 bits in half the layers, 8 where v_proj is Q8_0; gate_up also at 8 bits, as Q5_0 was
# held before the 5-bit format, to compare).
SHAPES = [("qkv", 960, 576, 4), ("o", 576, 576, 4), ("gate_up", 3072, 576, 4), ("down", 576, 1536, 4),
          ("lm_head", 49152, 576, 8), ("gemma qkv", 1536, 640, 5), ("gemma qkv", 1536, 640, 8),
          ("gemma o", 640, 1024, 4), ("gemma gate_up", 4096, 640, 5), ("gemma gate_up", 4096, 640, 8),
          ("gemma down", 640, 2048, 8), ("gemma lm_head", 262144, 640, 8)]
ROWS = (1, 8, 32, 64, 128, 256)


def set_shapes() -> list[tuple[str, int, int, int]]:
    """The layer shapes of benchmarks/model_set.py's models, as the engine fuses them (q/k/v, gate/up),
    at 4 and 8 bits, down also at 6 (Q4_K_M keeps some in Q6_K), and each lm_head (the SmolLM2
    vocabulary) at 6 and 8 (Q6_K in the 4-bit files, Q8_0 in the 8-bit ones); 6 bits only where the
    input width is whole super-blocks."""
    from model_set import SHAPES as MODELS  # beside this script
    from model_set import VOCAB_SIZE

    shapes = []
    for model in MODELS:
        m = spec_from_hf_config({**model["config"], "vocab_size": VOCAB_SIZE}, model["name"])
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        layers = [("qkv", q + 2 * kv, m.hidden_size), ("o", m.hidden_size, q),
                  ("gate_up", 2 * m.ffn_size, m.hidden_size), ("down", m.hidden_size, m.ffn_size)]
        shapes += [(f"{m.name} {layer}", n, k, bits) for layer, n, k in layers
                   for bits in ((4, 6, 8) if layer == "down" else (4, 8))]
        shapes += [(f"{m.name} lm_head", m.vocab_size, m.hidden_size, bits) for bits in (6, 8)]
    # Q6_K needs whole super-blocks: llama-quantize gives a tensor of other widths another type.
    return [shape for shape in shapes if shape[3] != 6 or shape[2] % SUPER_BLOCK == 0]


def _best_seconds(fn, x, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def int8_peak() -> dict:
    """benchmarks/int8_peak.c: the clock and the int8 MAC rate of the instructions the GEMM uses,
    measured on registers alone with every thread."""
    binary = ROOT / "build" / "int8_peak"
    binary.parent.mkdir(exist_ok=True)
    subprocess.run(["cc", "-O2", "-march=native", "-fopenmp", str(ROOT / "benchmarks" / "int8_peak.c"), "-o",
                    str(binary)], check=True)
    out = subprocess.run([str(binary), str(torch.get_num_threads())], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def _held_as(w: Quantized, form: ScaleFormat) -> Quantized:
    """A 4-bit weight whose block values the layer reads in `form` (the values made to fit it:
    for timing only): fp16 as a Q4_0 file's, super-block factors as a Q4_K file's."""
    if form == ScaleFormat.F16:
        low = None if w.min is None else w.min.half().float()
        return dataclasses.replace(w, scale=w.scale.half().float(), min=low)
    n, k = w.shape
    factors = tuple(SuperBlockValues((torch.rand(n, k // SUPER_BLOCK) * sign / 64).half(),
                                     torch.randint(0, 64, (n, k // 32), dtype=torch.uint8)) for sign in (1, -1))
    return dataclasses.replace(w, scale=factors[0].values(), min=factors[1].values(), factors=factors)


def _q6_k_like(n: int, k: int) -> Quantized:
    """Random 6-bit blocks with Q6_K's block values (an fp16 factor a super-block times an int8
    a half block), for timing: benchmarks/quant.py has no 6-bit quantiser."""
    scale = SuperBlockValues((torch.rand(n, k // SUPER_BLOCK) / 2048).half(),
                             torch.randint(-128, 128, (n, k // 16), dtype=torch.int8))
    return Quantized(6, torch.randint(-32, 32, (n, k), dtype=torch.int8), scale.values(), None, (scale, None))


def kernels(args: argparse.Namespace) -> dict:
    """GMAC/s per layer shape and row count: the kernel this CPU takes (AMX, then AVX-512 VNNI, where it has
    it), the AVX2 build of the same source, and oneDNN fp32; against the measured int8 peak. At 4
    bits also with the block values as a Q4_0 file's (fp16) and a Q4_K file's (super-block
    factors); the first column's are fp32."""
    torch.manual_seed(0)
    peak = int8_peak()
    # The CPU's peak, the fastest of the instructions it has (where 512-bit vpdpbusd runs at the
    # 256-bit rate, that is the ceiling).
    top = max(peak.get("amx_gmacs", 0.0), peak.get("dpbusd512_gmacs", 0.0), peak.get("dpbusd_gmacs", 0.0),
              peak["maddubs_gmacs"])
    print(f"int8 peak, {peak['threads']} threads at ~{peak['clock_ghz']:.2f} GHz: vpmaddubsw (+ its add) "
          f"{peak['maddubs_gmacs']:.0f} GMAC/s, vpdpbusd {peak.get('dpbusd_gmacs', 'n/a')} GMAC/s (256-bit), "
          f"{peak.get('dpbusd512_gmacs', 'n/a')} GMAC/s (512-bit)", flush=True)
    if "tile_q8_gmacs" in peak:
        print(f"the VNNI tiles' instructions on registers, 4 rows (8 rows): 8-bit {peak['tile_q8_gmacs']:.0f} "
              f"({peak['tile8_q8_gmacs']:.0f}), 4-bit {peak['tile_q4_gmacs']:.0f} ({peak['tile8_q4_gmacs']:.0f}), "
              f"4-bit with minimums {peak['tile_q4_minimums_gmacs']:.0f} ({peak['tile8_q4_minimums_gmacs']:.0f}) "
              "GMAC/s", flush=True)
    if peak.get("amx_gmacs"):
        print(f"AMX tile unit: {peak['amx_gmacs']:.0f} GMAC/s (tdpbssd, K = 64, registers only), "
              f"{peak['amx_block_gmacs']:.0f} GMAC/s on the GEMM's blocks of 32 (loads, multiply, sums stored)",
              flush=True)
    avx2 = kernels_lib.variant(("-mno-avx512vnni",))
    # Where the CPU has AMX the kernel this CPU takes runs whole tiles of 16 rows on it: the VNNI
    # build of the same source beside it.
    vnni = kernels_lib.variant(("-mno-amx-int8", "-mno-amx-tile")) if _cpu_has_amx() else None
    results: dict = {"peak": peak}
    meter = CpuMeter()
    for name, n, k, bits in SHAPES if args.shapes == "small" else set_shapes():
        weight = torch.randn(n, k) * 0.05
        blocks = _q6_k_like(n, k) if bits == 6 else quantize(weight, bits)
        quantized = QuantizedLinear(blocks)
        forms = (ScaleFormat.F16, ScaleFormat.SUPER_BLOCKS) if bits == 4 and k % SUPER_BLOCK == 0 else ()
        other_forms = {form: QuantizedLinear(_held_as(blocks, form)) for form in forms}
        assert all(layer.scale_format == form for form, layer in other_forms.items())
        dense = torch.nn.Linear(k, n, bias=False).requires_grad_(False)
        dense.weight.copy_(weight)
        fp32 = PackedLinear(dense, 2048, onednn=True, small_batch=True) if n * k < 1e8 else None
        for m in ROWS:
            x = torch.randn(m, k)
            reps = max(3, int(5e7 / (m * n * k)))
            rate = {"q": m * n * k / _best_seconds(quantized, x, reps) / 1e9}
            if vnni is not None:
                rate["q vnni"] = m * n * k / _best_seconds(partial(_run_on, vnni, quantized), x, reps) / 1e9
            if avx2 is not None:
                on_avx2 = partial(_run_on, avx2, quantized)
                rate["q avx2"] = m * n * k / _best_seconds(on_avx2, x, reps) / 1e9
            for form, layer in other_forms.items():
                rate[f"q {form.name.lower()}"] = m * n * k / _best_seconds(layer, x, reps) / 1e9
            if fp32 is not None:
                rate["fp32"] = m * n * k / _best_seconds(fp32, x, reps) / 1e9
            rate["q % of peak"] = 100 * rate["q"] / top
            ceiling = _tile_ceiling(peak, bits, blocks.min is not None)
            if ceiling:  # the VNNI tiles' ceiling: the VNNI build's rate where AMX takes the rows
                rate["q % of tile"] = 100 * rate.get("q vnni", rate["q"]) / ceiling
            if peak.get("amx_block_gmacs"):
                rate["q % of amx blocks"] = 100 * rate["q"] / peak["amx_block_gmacs"]
            results[f"{name} q{bits} M={m}"] = rate
            print(f"{name:14s} {n}x{k} q{bits} M={m:3d}: " + ", ".join(
                f"{key} {value:6.1f}" for key, value in rate.items()), flush=True)
    print(_other(meter))
    return results


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return "amx_int8" in f.read().split()


def _tile_ceiling(peak: dict, bits: int, minimums: bool) -> float | None:
    """GMAC/s of the VNNI tile's own instructions for a layer of these bits (int8_peak.c's tile_*):
    5 and 6 bits run the 8-bit tile over an unpacked panel, so its figure (their halves' extra
    scaling at 6 bits aside)."""
    if "tile_q8_gmacs" not in peak:
        return None
    if bits != 4:
        return peak["tile_q8_gmacs"]
    return peak["tile_q4_minimums_gmacs" if minimums else "tile_q4_gmacs"]


def _run_on(lib, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    y = torch.empty(x.shape[0], layer.out_features)
    lib.quant_linear(ctypes.byref(layer.kernel_args()), x.data_ptr(), y.data_ptr(), x.shape[0], torch.get_num_threads())
    return y


# ---- llama.cpp ----------------------------------------------------------------------------------
# llama-bench's tests: pp256 (one 256-token prompt), tg64 (64 tokens generated one at a time from
# an empty context), pp256+tg64 (both, as one rate over 320 tokens).
KEYS = ("pp256", "tg64", "pp256+tg64")


def _engine_batch1(llm: LLM, runs: int, offset: int) -> dict:
    """llama-bench's three tests on the engine, median of `runs`, read from each request's own
    timestamps: pp256 from scheduling to the first token, tg64 from scheduling a 1-token prompt to
    its 64th token, pp256+tg64 wall time around generate. Also tg64 after the 256-token prompt."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.tokenizer, 2 * runs, 256, offset)]
    full = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    pp, tg, e2e, tg_after = [], [], [], []
    for i in range(runs):
        t0 = time.perf_counter()
        timings = llm.generate([prompts[i]], full, progress=False)[0].timings
        e2e.append(320 / (time.perf_counter() - t0))
        assert timings.scheduled and timings.first_token and timings.finished
        pp.append(256 / (timings.first_token - timings.scheduled))
        tg_after.append(63 / (timings.finished - timings.first_token))
        timings = llm.generate([{"prompt_token_ids": prompts[runs + i]["prompt_token_ids"][:1]}], full,
                               progress=False)[0].timings
        assert timings.scheduled and timings.finished
        tg.append(64 / (timings.finished - timings.scheduled))
    median = statistics.median
    return {"pp256": median(pp), "tg64": median(tg), "pp256+tg64": median(e2e), "tg64 after pp256": median(tg_after)}


def _llama_bench(binary: Path, model: Path, runs: int) -> dict:
    out = subprocess.run([str(binary), "-m", str(model), "-p", "256", "-n", "64", "-pg", "256,64", "-t",
                          str(torch.get_num_threads()), "-r", str(runs), "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rows = json.loads(out[out.index("[") :])
    result = {}
    for row in rows:
        p, n = row["n_prompt"], row["n_gen"]
        name = f"pp{p}+tg{n}" if p and n else f"pp{p}" if p else f"tg{n}"
        result[name] = row["avg_ts"]
    return result


def llamacpp(args: argparse.Namespace) -> dict:
    """Rounds of llama-bench then the engine, back to back: this machine's speed drifts by ±15%
    over minutes, so each round's ratio compares the two under the same conditions."""
    binary = Path(args.llama_bench)
    if not binary.is_file():
        raise SystemExit(f"{binary}: not built; run `bash benchmarks/setup_llamacpp.sh` first")
    model = Path(args.model) if args.model else embedded_model_path()
    llm = LLM(args.model, weight_format="auto", max_num_seqs=1)
    llm.generate([{"prompt_token_ids": [1] * 8}], SamplingParams(max_tokens=8), progress=False)  # warm-up
    rounds = []
    for r in range(args.rounds):
        meter = CpuMeter()
        round_ = {"llama.cpp": _llama_bench(binary, model, args.runs),
                  "tokenmill auto": _engine_batch1(llm, args.runs, offset=2 * args.runs * r)}
        round_["ratio"] = {k: round_["tokenmill auto"][k] / round_["llama.cpp"][k] for k in KEYS}
        round_["other_cpu_seconds"] = meter.other_seconds()
        rounds.append(round_)
        for name in ("llama.cpp", "tokenmill auto", "ratio"):
            unit = "x" if name == "ratio" else " tok/s"
            print(f"round {r + 1} {name:15s} " + "  ".join(f"{k} {v:7.2f}{unit}" for k, v in round_[name].items()),
                  *([_other(meter)] if name == "ratio" else []), flush=True)
    meter = CpuMeter()
    fp32 = _engine_batch1(LLM(args.model, weight_format="fp32", max_num_seqs=1), args.runs, offset=0)
    print("tokenmill fp32  " + "  ".join(f"{k} {v:7.1f} tok/s" for k, v in fp32.items()), _other(meter))
    ratios = {k: statistics.median(r["ratio"][k] for r in rounds) for k in KEYS}
    print("tokenmill auto / llama.cpp, median of the rounds' ratios: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return {"rounds": rounds, "median_ratio": ratios, "tokenmill fp32": fp32}


# ---- steady -----------------------------------------------------------------------------------
def steady(args: argparse.Namespace) -> dict:
    """Batches of 32 × (256 in / 64 out) back to back in one engine for --minutes: output tok/s per
    batch, then the first five minutes against the last five. The prompts repeat every 8 batches,
    so the prefix cache is off: every batch computes all of its prompts."""
    llm = LLM(args.model, weight_format=args.weight_format, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    pool = _prompts(llm.tokenizer, 256, 256)
    rows, start, i = [], time.perf_counter(), 0
    while time.perf_counter() - start < args.minutes * 60:
        batch = [{"prompt_token_ids": pool[(i * 32 + j) % len(pool)][j % 7 :]} for j in range(32)]
        meter, t0 = CpuMeter(), time.perf_counter()
        llm.generate(batch, params, progress=False)
        wall = time.perf_counter() - t0
        rows.append({"t_min": round((t0 - start) / 60, 2), "out_tok_s": round(32 * 64 / wall, 1),
                     "other_cpu_s": meter.other_seconds()})
        print(json.dumps(rows[-1]), flush=True)
        i += 1
    first = [r["out_tok_s"] for r in rows if r["t_min"] < 5]
    last = [r["out_tok_s"] for r in rows if r["t_min"] >= args.minutes - 5]
    summary = {"first_5_min": statistics.mean(first), "last_5_min": statistics.mean(last), "batches": len(rows)}
    summary["change"] = f"{summary['last_5_min'] / summary['first_5_min'] - 1:+.1%}"
    print(json.dumps(summary))
    return {"summary": summary, "batches": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["accuracy", "kernels", "llamacpp", "steady"])
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--shapes", choices=["small", "set"], default="small",
                        help="kernels: the real models' layers, or those of benchmarks/model_set.py's set")
    parser.add_argument("--windows", type=int, default=12, help="accuracy: 512-token windows scored")
    parser.add_argument("--runs", type=int, default=3, help="llamacpp: runs of each test per round")
    parser.add_argument("--rounds", type=int, default=3, help="llamacpp: llama-bench then the engine, this often")
    parser.add_argument("--llama-bench", default=str(LLAMA_BENCH))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--weight-format", default="auto")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {"accuracy": accuracy, "kernels": kernels, "llamacpp": llamacpp, "steady": steady}[args.what](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
