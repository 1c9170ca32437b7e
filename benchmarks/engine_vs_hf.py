"""Engine vs `transformers.generate` on the embedded model, measured in the same run.

    python benchmarks/engine_vs_hf.py                       # every scenario, 3 runs each, medians
    python benchmarks/engine_vs_hf.py --scenarios fixed --batch-sizes 32 --runs 1
    python benchmarks/engine_vs_hf.py --scenarios batch1,fixed --batch-sizes 32 --model gemma3-270m

Scenarios (the targets of the engine-speed issue):
  fixed   256 prompt / 64 output tokens, batch 32 and 64 (and any --batch-sizes)
  batch1  one request, 256 prompt / 64 output: decode speed
  mixed   128 chat requests, documents of lognormal length (32-1,024 tokens), natural stops, max 128
  shared  128 classification requests: one 512-token instruction + a 64-192-token document, <= 8 out
  hol     4 prompts of 4,000 tokens among 60 of 100: short-request TTFT, fcfs/no chunking vs length policy
Every number is printed beside the baseline measured in the same process, with the CPU seconds
other processes used meanwhile (a busy machine makes two-thread GEMMs collapse).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter
from tokenmill.models.loader import LoadedWeights, load_weights

CORPUS = Path(__file__).resolve().parents[1] / "benchmarks" / "corpus.txt"


# ---- measurement helpers ----------------------------------------------------------------------
@dataclass
class Timed:
    wall: float
    other_cpu_s: float  # CPU seconds used by other processes during the run
    result: object = None


def timed(fn: Callable[[], object]) -> Timed:
    meter, t0 = CpuMeter(), time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    other = meter.other_seconds()
    if other is None:
        raise OSError("no /proc/stat: cannot report other processes' CPU use, so no honest number")
    return Timed(wall, other, result)


def gemm_flops_per_s() -> float:
    """fp32 GEMM rate of this machine now, at the model's prefill shape (best of 5)."""
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048 * 576 * 1536 / best


# ---- workloads --------------------------------------------------------------------------------
class Texts:
    """Real text cut to exact token lengths (distinct windows, so runs do not share prefixes)."""

    def __init__(self, tokenizer, seed: int) -> None:  # type: ignore[no-untyped-def]
        self.ids = tokenizer.encode(CORPUS.read_text())
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.ids) - n)
        return self.ids[start : start + n]


def workload_flops(weights: LoadedWeights, prompt_lens: list[int], output_lens: list[int]) -> float:
    cfg = weights.config
    layer_params = sum(v.numel() for k, v in weights.state_dict.items() if ".layers." in k)
    per_token = 2 * layer_params
    head = 2 * cfg.hidden_size * cfg.vocab_size
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim  # x context length
    total = 0.0
    for p, o in zip(prompt_lens, output_lens, strict=True):
        n = p + o
        total += per_token * n + head * (o + 1) + attn * n * n / 2
    return total


# ---- the two systems ----------------------------------------------------------------------------
def hf_model(weights: LoadedWeights) -> torch.nn.Module:
    """transformers' model on the same weights: a Llama built from ours (the embedded SmolLM2), or,
    for any other GGUF, transformers reading and dequantising the file itself, in fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    c = weights.config
    source = Path(weights.source)
    if c.model_type != "llama" and source.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        return model.eval()
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(weights.state_dict, strict=False)
    return model.eval()


@torch.inference_mode()
def hf_generate(model, batches: list[list[list[int]]], max_new: int, eos: list[int] | None) -> list[int]:  # type: ignore[no-untyped-def]
    """Static batches, left-padded; returns each request's useful output length."""
    lengths = []
    for batch in batches:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kwargs = {"eos_token_id": eos} if eos else {"min_new_tokens": max_new}
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=0, **kwargs)
        for row in out[:, width:].tolist():
            n = len(row)
            if eos:
                n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            lengths.append(n)
    return lengths


def engine_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:  # type: ignore[type-arg]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)


# ---- scenarios --------------------------------------------------------------------------------
@dataclass
class Row:
    scenario: str
    metric: str
    engine: float
    baseline: float
    ratio: float
    target: str
    runs: list[dict] = field(default_factory=list)  # type: ignore[type-arg]
    note: str = ""


def _median_runs(runs: int, fn: Callable[[int], dict]) -> tuple[dict, list[dict]]:  # type: ignore[type-arg]
    results = [fn(r) for r in range(runs)]
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in results) for k in keys}, results


def scenario_fixed(ctx: Ctx, batch: int) -> Row:
    def one(run: int) -> dict:  # type: ignore[type-arg]
        texts = Texts(ctx.tok, seed=1000 * batch + run)
        prompts = [texts.take(256) for _ in range(batch)]
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        ctx.llm.engine.set_max_num_seqs(batch)
        eng = timed(lambda: engine_generate(ctx.llm, prompts, params))
        hf = timed(lambda: hf_generate(ctx.hf, [prompts], 64, None))
        gemm = gemm_flops_per_s()
        ceiling = batch * 64 / (workload_flops(ctx.weights, [256] * batch, [64] * batch) / gemm)
        return {"engine_tok_s": batch * 64 / eng.wall, "hf_tok_s": batch * 64 / hf.wall,
                "ceiling_tok_s": ceiling, "gemm_gflops": gemm / 1e9,
                "other_cpu_s": eng.other_cpu_s + hf.other_cpu_s}

    med, runs = _median_runs(ctx.runs, one)
    return Row(f"fixed 256/64 batch {batch}", "output tok/s", med["engine_tok_s"], med["hf_tok_s"],
               med["engine_tok_s"] / med["hf_tok_s"], "≥ 1.35×", runs,
               f"{med['engine_tok_s'] / med['ceiling_tok_s']:.0%} of compute ceiling "
               f"({med['ceiling_tok_s']:.0f} tok/s at {med['gemm_gflops']:.0f} GFLOP/s)")


def scenario_batch1(ctx: Ctx) -> Row:
    def one(run: int) -> dict:  # type: ignore[type-arg]
        prompt = Texts(ctx.tok, seed=77 + run).take(256)
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        ctx.llm.engine.set_max_num_seqs(1)
        eng = timed(lambda: engine_generate(ctx.llm, [prompt], params))
        out = eng.result[0]  # type: ignore[index]
        decode_s = out.timings.finished - out.timings.first_token
        hf_prefill = timed(lambda: hf_generate(ctx.hf, [[prompt]], 1, None))
        hf = timed(lambda: hf_generate(ctx.hf, [[prompt]], 64, None))
        return {"engine_decode_tok_s": 63 / decode_s, "hf_decode_tok_s": 63 / (hf.wall - hf_prefill.wall),
                "other_cpu_s": eng.other_cpu_s + hf.other_cpu_s}

    med, runs = _median_runs(ctx.runs, one)
    return Row("batch 1, 256/64", "decode tok/s", med["engine_decode_tok_s"], med["hf_decode_tok_s"],
               med["engine_decode_tok_s"] / med["hf_decode_tok_s"], "≥ 1.5×", runs)


def _chat_ids(ctx: Ctx, system: str | None, user: str) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return ctx.llm.chat_token_ids(messages)


def scenario_mixed(ctx: Ctx) -> Row:
    def one(run: int) -> dict:  # type: ignore[type-arg]
        texts, rng = Texts(ctx.tok, seed=500 + run), random.Random(run)
        lens = [min(1024, max(32, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(128)]
        prompts = [_chat_ids(ctx, None, "Summarise this text in two sentences:\n"
                             + ctx.tok.decode(texts.take(n))) for n in lens]
        eos = ctx.llm.engine.eos_token_ids
        ctx.llm.engine.set_max_num_seqs(64)
        eng = timed(lambda: engine_generate(ctx.llm, prompts, SamplingParams(max_tokens=128, temperature=0)))
        eng_tokens = sum(o.num_output_tokens for o in eng.result)  # type: ignore[attr-defined]
        hf = timed(lambda: hf_generate(ctx.hf, [prompts[i : i + 32] for i in range(0, 128, 32)], 128, eos))
        return {"engine_tok_s": eng_tokens / eng.wall, "hf_tok_s": sum(hf.result) / hf.wall,  # type: ignore[arg-type]
                "engine_tokens": eng_tokens, "hf_tokens": sum(hf.result),  # type: ignore[arg-type]
                "other_cpu_s": eng.other_cpu_s + hf.other_cpu_s}

    med, runs = _median_runs(ctx.runs, one)
    return Row("mixed 32–1,024 in, ≤128 out, 128 requests", "output tok/s", med["engine_tok_s"],
               med["hf_tok_s"], med["engine_tok_s"] / med["hf_tok_s"], "≥ 2.5×", runs,
               f"output tokens engine {med['engine_tokens']:.0f} / transformers {med['hf_tokens']:.0f}")


def scenario_shared(ctx: Ctx) -> Row:
    def one(run: int) -> dict:  # type: ignore[type-arg]
        texts, rng = Texts(ctx.tok, seed=900 + run), random.Random(run)
        instruction = ("Classify the document into one of: news, fiction, code, legal, other. " * 0
                       + ctx.tok.decode(texts.take(500)) + "\nAnswer with one word.")
        prompts = [_chat_ids(ctx, instruction, ctx.tok.decode(texts.take(rng.randrange(64, 193))))
                   for _ in range(128)]
        unique = len(prompts[0]) + sum(len(p) - _shared_len(prompts[0], p) for p in prompts[1:])
        before = ctx.llm.engine.stats().prefill_tokens
        ctx.llm.engine.set_max_num_seqs(64)
        eng = timed(lambda: engine_generate(ctx.llm, prompts, SamplingParams(max_tokens=8, temperature=0)))
        computed = ctx.llm.engine.stats().prefill_tokens - before
        eng_tokens = sum(o.num_output_tokens for o in eng.result)  # type: ignore[attr-defined]
        eos = ctx.llm.engine.eos_token_ids
        hf = timed(lambda: hf_generate(ctx.hf, [prompts[i : i + 32] for i in range(0, 128, 32)], 8, eos))
        return {"engine_req_s": 128 / eng.wall, "hf_req_s": 128 / hf.wall, "computed_over_unique": computed / unique,
                "engine_tokens": eng_tokens, "other_cpu_s": eng.other_cpu_s + hf.other_cpu_s}

    med, runs = _median_runs(ctx.runs, one)
    return Row("shared 512-token instruction, 128 requests", "requests/s", med["engine_req_s"], med["hf_req_s"],
               med["engine_req_s"] / med["hf_req_s"], "≥ 4×, computed ≤ 1.1× unique", runs,
               f"prompt tokens computed / unique = {med['computed_over_unique']:.2f}")


def _shared_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def scenario_hol(ctx: Ctx) -> Row:
    def run_policy(prompts: list[list[int]], short: set[int], **cfg: object) -> dict:  # type: ignore[type-arg]
        llm = LLM(weights=ctx.weights, max_model_len=4096, max_num_seqs=64, **cfg)
        res = timed(lambda: engine_generate(llm, prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                          ignore_eos=True)))
        outs = res.result
        ttft = sorted(outs[i].timings.time_to_first_token for i in short)  # type: ignore[index]
        tokens = sum(o.num_prompt_tokens + o.num_output_tokens for o in outs)  # type: ignore[attr-defined]
        return {"p95_ttft": ttft[int(0.95 * (len(ttft) - 1))], "tok_s": tokens / res.wall,
                "other_cpu_s": res.other_cpu_s}

    def one(run: int) -> dict:  # type: ignore[type-arg]
        texts = Texts(ctx.tok, seed=300 + run)
        prompts = [texts.take(100) for _ in range(60)]
        for i, pos in enumerate((0, 15, 30, 45)):
            prompts.insert(pos + i, texts.take(4000))
        short = {i for i, p in enumerate(prompts) if len(p) == 100}
        fcfs = run_policy(prompts, short, enable_chunked_prefill=False, max_num_batched_tokens=4096)
        length = run_policy(prompts, short, scheduling_policy="length", max_num_batched_tokens=512)
        return {"fcfs_p95_ttft": fcfs["p95_ttft"], "length_p95_ttft": length["p95_ttft"],
                "fcfs_tok_s": fcfs["tok_s"], "length_tok_s": length["tok_s"],
                "other_cpu_s": fcfs["other_cpu_s"] + length["other_cpu_s"]}

    med, runs = _median_runs(ctx.runs, one)
    return Row("head-of-line: 4×4,000 among 60×100", "short p95 TTFT s (length vs fcfs, no chunking)",
               med["length_p95_ttft"], med["fcfs_p95_ttft"], med["length_p95_ttft"] / med["fcfs_p95_ttft"],
               "≤ 0.33×, throughput loss ≤ 10%", runs,
               f"total tok/s length {med['length_tok_s']:.0f} vs fcfs {med['fcfs_tok_s']:.0f} "
               f"({med['length_tok_s'] / med['fcfs_tok_s'] - 1:+.0%})")


@dataclass
class Ctx:
    weights: LoadedWeights
    llm: LLM
    hf: torch.nn.Module
    tok: object
    runs: int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="fixed,batch1,mixed,shared,hol")
    ap.add_argument("--batch-sizes", default="32,64")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--model", help="a GGUF file, folder or named model (default: the embedded SmolLM2)")
    args = ap.parse_args()
    weights = load_weights(args.model)
    ctx = Ctx(weights, LLM(weights=weights, max_model_len=2048), hf_model(weights), weights.tokenizer, args.runs)
    runners: list[Callable[[], Row]] = []
    for name in args.scenarios.split(","):
        if name == "fixed":
            runners += [lambda b=int(b): scenario_fixed(ctx, b) for b in args.batch_sizes.split(",")]
        else:
            fn = {"batch1": scenario_batch1, "mixed": scenario_mixed, "shared": scenario_shared,
                  "hol": scenario_hol}[name]
            runners.append(lambda fn=fn: fn(ctx))
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for run_scenario in runners:
        rows.append(run_scenario())
        print(_row_line(rows[-1]), flush=True)
        # Written after every scenario: a long run that dies later keeps what it measured.
        (args.out / "engine_vs_hf.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        (args.out / "engine_vs_hf.md").write_text(_markdown(rows, args))
    print(_markdown(rows, args))


def _row_line(r: Row) -> str:
    other = max(run.get("other_cpu_s", 0) for run in r.runs)
    return (f"{r.scenario}: {r.metric} engine {r.engine:.2f} vs transformers {r.baseline:.2f} = "
            f"{r.ratio:.2f}× (target {r.target}) {r.note} [other CPU ≤ {other:.1f} s/run]")


def _markdown(rows: list[Row], args: argparse.Namespace) -> str:
    model = f" --model {args.model}" if args.model else ""
    lines = [f"`python benchmarks/engine_vs_hf.py --scenarios {args.scenarios} --batch-sizes {args.batch_sizes} "
             f"--runs {args.runs}{model}` (medians of {args.runs}; model {Path(args.model or 'SmolLM2').name})", "",
             "| scenario | metric | tokenmill | transformers | ratio | target | notes | other CPU s/run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        other = max(run.get("other_cpu_s", 0) for run in r.runs)
        lines.append(f"| {r.scenario} | {r.metric} | {r.engine:.2f} | {r.baseline:.2f} | {r.ratio:.2f}× | "
                     f"{r.target} | {r.note} | {other:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
