"""Structured outputs on the embedded model: what a JSON schema costs, measured in one run.

    python benchmarks/structured.py              # B=32, 256-token prompts, greedy and sampled
    python benchmarks/structured.py --quick      # B=8, few tokens: a smoke run, numbers mean nothing

Everything below runs on the same prompts in the same process:
  throughput  JSON-schema-constrained output tok/s vs an unconstrained run that generates exactly as
              many tokens per request (ignore_eos, max_tokens = the constrained length), so the two
              differ only by the grammar (target >= 0.85x); also over decode-only steps; a free-text
              run with natural stops is shown beside them. Greedy, and sampled unless --no-sampled.
              The prefix cache is off, so that every run prefills the same prompts alike.
  validity    the share of constrained answers that parse and validate (jsonschema); finish reasons
  mask time   allowed_tokens_bitmask (llguidance computes the bits) and apply_bitmask (disallowed
              logits to -inf), timed inside every engine step by wrapping the names the sampler
              imports, against the step's own time
  apply       the C kernel vs numpy unpackbits + torch masked_fill (the fallback) vs llguidance's
              numpy and torch.compile helpers, on the bitmasks the constrained run produced; all
              must give identical logits
  choice      3 labels: steps that produced a token for a request vs the tokens of its label
              (equal: the grammar ends the request, no extra step for EOS)
The other processes' CPU use is recorded with every number (a busy machine ruins CPU benchmarks).
Writes structured.{json,md,png} to --out (benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import torch

import tokenmill.engine.sampler as sampler_module
from tokenmill.bench.runner import CpuMeter
from tokenmill.engine import LLM, RequestOutput, SamplingParams, StructuredOutputsParams
from tokenmill.engine import structured_outputs as so_module
from tokenmill.models import kernels
from tokenmill.models.loader import load_weights

CORPUS = Path(__file__).resolve().parent / "corpus.txt"
# Labels of 2-3 tokens each (in this tokenizer), so the choice check is more than one step.
LABELS = ["informative", "persuasive", "narrative"]
INSTRUCTION = (
    "Read the text and classify its style as informative, persuasive or narrative. Answer in JSON with "
    'a "label", a "summary" of at most 60 characters, and your "confidence" between 0 and 1.'
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": LABELS},
        "summary": {"type": "string", "maxLength": 60},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["label", "summary", "confidence"],
    "additionalProperties": False,
}


# ---- the machine ----------------------------------------------------------------------------------
def process_cpu_seconds() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by every other process: pid -> (command line, seconds)."""
    hz = os.sysconf("SC_CLK_TCK")
    used = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:  # gone meanwhile
            continue
        after_name = stat[stat.rindex(")") + 2 :].split()
        name = cmdline or stat[stat.index("(") + 1 : stat.rindex(")")]
        used[int(entry)] = (name[:80], (int(after_name[11]) + int(after_name[12])) / hz)  # utime + stime
    return used


def busiest(before: dict[int, tuple[str, float]], top: int = 3) -> list[dict[str, Any]]:
    """The other processes that used the most CPU since `before` (process_cpu_seconds())."""
    after = process_cpu_seconds()
    used = [(after[pid][1] - seconds, pid, name) for pid, (name, seconds) in before.items() if pid in after]
    used.sort(reverse=True)
    return [{"pid": pid, "cpu_s": round(cpu, 2), "cmd": name} for cpu, pid, name in used[:top] if cpu >= 0.01]


def busiest_now(window_s: float = 1.0) -> dict[str, Any]:
    """Other processes' CPU use over a short window: cores in use in all, and the busiest few."""
    before = process_cpu_seconds()
    time.sleep(window_s)
    top = busiest(before, top=1000)
    return {"other_cores_in_use": round(sum(p["cpu_s"] for p in top) / window_s, 2), "busiest": top[:5]}


def measured(fn: Callable[[], list[RequestOutput]]) -> tuple[list[RequestOutput], float, float, list[dict[str, Any]]]:
    """(outputs, wall seconds, CPU seconds other processes used meanwhile, the busiest of them)."""
    processes, meter, start = process_cpu_seconds(), CpuMeter(), time.perf_counter()
    outputs = fn()
    wall = time.perf_counter() - start
    other = meter.other_seconds()
    if other is None:
        raise OSError("no /proc/stat: cannot report other processes' CPU use, so no honest number")
    return outputs, wall, other, busiest(processes)


# ---- prompts ----------------------------------------------------------------------------------------
def build_prompts(llm: LLM, count: int, length: int, seed: int) -> list[list[int]]:
    """Chat prompts of `length` tokens (give or take one): the instruction, then a window of real
    text. Distinct windows, so the prefix cache shares only the instruction."""
    tok = llm.tokenizer
    corpus = tok.encode(CORPUS.read_text(), add_special_tokens=False)
    rng = random.Random(seed)

    def chat(text: str) -> list[int]:
        return llm.chat_token_ids([{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}])

    overhead = len(chat(""))
    prompts = []
    for _ in range(count):
        start, take = rng.randrange(len(corpus) - 2 * length), length - overhead
        for _ in range(4):  # re-encoding a decoded window can merge or split a token at the edges
            ids = chat(tok.decode(corpus[start : start + take]).strip())
            if len(ids) == length:
                break
            take += length - len(ids)
        prompts.append(ids)
    return prompts


# ---- runs, with the mask timed inside each step ---------------------------------------------------
@dataclass
class StepRecord:
    seconds: float
    mask_compute_s: float = 0.0  # allowed_tokens_bitmask
    mask_apply_s: float = 0.0  # apply_bitmask
    constrained_rows: int = 0
    rows: int = 0  # rows sampled (all of them, constrained or not)
    prefill_tokens: int = 0  # 0: a decode-only step


@dataclass
class Run:
    name: str
    outputs: list[RequestOutput]
    wall_s: float
    other_cpu_s: float
    steps: list[StepRecord]
    tokens_per_request: Counter[str]  # steps that gave a request a token
    busiest_others: list[dict[str, Any]]  # the other processes that used the most CPU meanwhile

    @property
    def output_tokens(self) -> int:
        return sum(o.num_output_tokens for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second of the decode-only steps: the steady state, without prefill."""
        decode = [s for s in self.steps if not s.prefill_tokens]
        return sum(s.rows for s in decode) / sum(s.seconds for s in decode) if decode else float("nan")

    def finish_reasons(self) -> dict[str, int]:
        return dict(Counter(str(o.finish_reason) for o in self.outputs))

    def summary(self) -> dict[str, Any]:
        masked = [s for s in self.steps if s.constrained_rows]
        return {"name": self.name, "requests": len(self.outputs), "output_tokens": self.output_tokens,
                "wall_s": round(self.wall_s, 3), "output_tok_s": round(self.tok_s, 2),
                "decode_tok_s": round(self.decode_tok_s, 2),
                "finish_reasons": self.finish_reasons(), "steps": len(self.steps),
                "steps_with_mask": len(masked),
                "median_step_ms": round(1e3 * statistics.median(s.seconds for s in self.steps), 2),
                "other_cpu_s": self.other_cpu_s, "busiest_others": self.busiest_others}


class StepRecorder:
    """Times every engine step of `llm`, and the mask's two halves inside it, by wrapping the
    functions the sampler module imported (so the engine itself is unchanged). Keeps a copy of
    each full-batch bitmask, for the apply comparison."""

    def __init__(self, llm: LLM, full_batch: int) -> None:
        self.llm, self.full_batch = llm, full_batch
        self.steps: list[StepRecord] = []
        self.tokens_per_request: Counter[str] = Counter()
        self.bitmasks: list[np.ndarray] = []
        self._current: StepRecord | None = None

    @contextmanager
    def installed(self) -> Iterator[StepRecorder]:
        engine = self.llm.engine
        real_step, real_compute = engine.step, sampler_module.allowed_tokens_bitmask
        real_apply = sampler_module.apply_bitmask

        def step() -> list[RequestOutput]:
            self._current = record = StepRecord(0.0)
            prefilled = engine.stats().prefill_tokens
            start = time.perf_counter()
            outputs = real_step()
            record.seconds = time.perf_counter() - start
            record.rows = len(outputs)
            record.prefill_tokens = engine.stats().prefill_tokens - prefilled
            if outputs:  # an empty schedule is no step
                self.steps.append(record)
            self.tokens_per_request.update(o.request_id for o in outputs)
            return outputs

        def compute(matchers: list, rows: int, vocab: int) -> np.ndarray:  # type: ignore[type-arg]
            start = time.perf_counter()
            bitmask = real_compute(matchers, rows, vocab)
            record = self._current
            assert record is not None
            record.mask_compute_s += time.perf_counter() - start
            record.constrained_rows += len(matchers)
            if rows == self.full_batch:
                self.bitmasks.append(bitmask.copy())  # ~0.2 MB memcpy, outside the timed part
            return bitmask

        def apply(logits: torch.Tensor, bitmask: np.ndarray) -> None:
            start = time.perf_counter()
            real_apply(logits, bitmask)
            assert self._current is not None
            self._current.mask_apply_s += time.perf_counter() - start

        engine.step = step  # type: ignore[method-assign]
        sampler_module.allowed_tokens_bitmask, sampler_module.apply_bitmask = compute, apply  # type: ignore[assignment]
        try:
            yield self
        finally:
            del engine.step  # back to the class's method
            sampler_module.allowed_tokens_bitmask, sampler_module.apply_bitmask = real_compute, real_apply


def run(llm: LLM, name: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        full_batch: int) -> tuple[Run, list[np.ndarray]]:
    recorder = StepRecorder(llm, full_batch)
    with recorder.installed():
        outputs, wall, other, others = measured(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False))
    errors = [o.error for o in outputs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
    result = Run(name, outputs, wall, other, recorder.steps, recorder.tokens_per_request, others)
    print(f"  {name}: {result.output_tokens} tokens in {wall:.1f} s = {result.tok_s:.1f} tok/s "
          f"(decode steps {result.decode_tok_s:.1f} tok/s) {result.finish_reasons()} [other CPU {other:.1f} s"
          + (f", most by {others[0]['cmd']!r}]" if others else "]"), flush=True)
    return result, recorder.bitmasks


def matched(constrained: Run, params: SamplingParams) -> list[SamplingParams]:
    """Unconstrained params that generate exactly as many tokens per request as `constrained` did."""
    return [SamplingParams(max_tokens=max(1, o.num_output_tokens), temperature=params.temperature,
                           top_p=params.top_p, seed=params.seed, ignore_eos=True) for o in constrained.outputs]


def validity(run_: Run) -> dict[str, Any]:
    """How many answers parse as JSON and validate against SCHEMA, with one valid and one invalid
    answer to look at."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    parsed = valid = 0
    examples: dict[str, str] = {}
    for out in run_.outputs:
        try:
            ok = validator.is_valid(json.loads(out.text))
            parsed += 1
        except json.JSONDecodeError:
            ok = False
        valid += ok
        examples.setdefault("valid" if ok else f"invalid ({out.finish_reason})", out.text)
    n = len(run_.outputs)
    return {"parse": parsed, "valid": valid, "requests": n, "valid_share": valid / n, "examples": examples}


def mask_timing(run_: Run) -> dict[str, Any]:
    """Mask time per engine step (steps that had constrained rows) and per constrained row."""
    masked = [s for s in run_.steps if s.constrained_rows]
    rows = sum(s.constrained_rows for s in masked)
    step_total = sum(s.seconds for s in masked)

    def half(values: list[float]) -> dict[str, float]:
        return {"median_ms_per_step": 1e3 * statistics.median(values),
                "mean_ms_per_step": 1e3 * statistics.mean(values),
                "us_per_row": 1e6 * sum(values) / rows, "share_of_step": sum(values) / step_total}

    return {"steps": len(masked), "rows": rows,
            "compute": half([s.mask_compute_s for s in masked]), "apply": half([s.mask_apply_s for s in masked]),
            "median_step_ms": 1e3 * statistics.median(s.seconds for s in masked)}


# ---- applying a bitmask: the ways compared ----------------------------------------------------------
def mask_stats(bitmasks: list[np.ndarray], vocab: int) -> dict[str, float]:
    allowed = [np.unpackbits(b.view(np.uint8), axis=1, bitorder="little")[:, :vocab].sum(axis=1) for b in bitmasks]
    words = np.concatenate([b.ravel() for b in bitmasks])
    return {"median_allowed_tokens_per_row": float(np.median(np.concatenate(allowed))),
            "words_all_allowed": float(np.mean(words == -1)), "words_none_allowed": float(np.mean(words == 0))}


def apply_methods() -> dict[str, Callable[[torch.Tensor, np.ndarray], None]]:
    import llguidance.numpy
    import llguidance.torch

    methods: dict[str, Callable[[torch.Tensor, np.ndarray], None]] = {}
    lib = kernels.library()
    if lib is not None:  # apply_bitmask takes the C path for contiguous fp32 logits
        methods["C kernel (tokenmill)"] = so_module.apply_bitmask

        def row_by_row(logits: torch.Tensor, bitmask: np.ndarray) -> None:
            for r in range(logits.shape[0]):
                so_module.apply_bitmask(logits[r : r + 1], bitmask[r : r + 1])

        # One row per call never reaches the kernel's OpenMP threshold: shows what its threads cost.
        methods["C kernel, one row per call"] = row_by_row
    methods["numpy unpackbits + torch masked_fill"] = so_module.apply_bitmask_unpacked
    methods["llguidance.numpy"] = lambda x, m: llguidance.numpy.apply_token_bitmask_inplace(x.numpy(), m)
    methods["llguidance.torch (torch.compile)"] = (
        lambda x, m: llguidance.torch.apply_token_bitmask_inplace(x, torch.from_numpy(m)))
    return methods


def compare_apply(bitmasks: list[np.ndarray], vocab: int, rounds: int) -> dict[str, Any]:
    """ms per step of each way to apply the run's own bitmasks to [B, vocab] fp32 logits; the first
    call of each is timed apart (torch.compile compiles there), and every result must equal the
    first method's, -inf for -inf."""
    rows = bitmasks[0].shape[0]
    base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    reference: list[torch.Tensor] = []
    results: dict[str, Any] = {}
    for name, fn in apply_methods().items():
        print(f"  apply: {name} ...", flush=True)
        entry: dict[str, Any] = {}
        results[name] = entry
        try:
            first = base.clone()
            start = time.perf_counter()
            fn(first, bitmasks[0])
            entry["first_call_s"] = time.perf_counter() - start
            times, identical = [], True
            for r in range(rounds):
                for i, bitmask in enumerate(bitmasks):
                    logits = base.clone()
                    start = time.perf_counter()
                    fn(logits, bitmask)
                    times.append(time.perf_counter() - start)
                    if r == 0:
                        if len(reference) < len(bitmasks):
                            reference.append(logits)
                        identical &= torch.equal(logits, reference[i])
            entry.update(ms_per_step=1e3 * statistics.median(times), identical_logits=identical)
        except Exception as exc:  # torch.compile needs a C++ toolchain; its failure is a result here
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    fastest = min((e["ms_per_step"] for e in results.values() if "ms_per_step" in e), default=None)
    for entry in results.values():
        if "ms_per_step" in entry and fastest:
            entry["vs_fastest"] = entry["ms_per_step"] / fastest
    return results


# ---- choice ---------------------------------------------------------------------------------------
def choice_steps(run_: Run, llm: LLM) -> dict[str, Any]:
    """Per chosen label: its canonical tokens, the tokens generated, and the steps that gave its
    requests a token. Steps = tokens generated means no extra step for the end; tokens generated >
    canonical tokens means the grammar let the model spell the label in smaller pieces."""
    tok = llm.tokenizer
    per_label: dict[str, dict[str, Any]] = {}
    for out in run_.outputs:
        steps = run_.tokens_per_request[out.request_id]
        entry = per_label.setdefault(out.text, {
            "label_tokens": len(tok.encode(out.text, add_special_tokens=False)), "requests": 0,
            "generated_tokens": Counter(), "steps": Counter(), "pieces": [tok.decode([t]) for t in out.token_ids]})
        entry["requests"] += 1
        entry["generated_tokens"][out.num_output_tokens] += 1
        entry["steps"][steps] += 1
    for entry in per_label.values():
        entry["generated_tokens"], entry["steps"] = dict(entry["generated_tokens"]), dict(entry["steps"])
    outputs = run_.outputs
    return {"per_label": per_label,
            "steps_differ_from_generated_tokens": sum(
                run_.tokens_per_request[o.request_id] != o.num_output_tokens for o in outputs),
            "steps_differ_from_label_tokens": sum(
                run_.tokens_per_request[o.request_id] != len(tok.encode(o.text, add_special_tokens=False))
                for o in outputs)}


# ---- report -----------------------------------------------------------------------------------------
def markdown(report: dict[str, Any]) -> str:
    lines = [f"`{report['command']}`" + (" — QUICK smoke run: the numbers mean nothing" if report["quick"] else ""),
             "", f"Embedded model, B={report['batch']}, {report['prompt_tokens']}-token prompts, "
             f"max_tokens {report['max_tokens']}, torch threads {report['torch_threads']}, "
             f"{report['cpu_count']} CPUs. Schema: `{json.dumps(SCHEMA)}`", "",
             "| run | output tokens | wall s | output tok/s | ratio | decode-step tok/s | ratio | finish reasons "
             "| median step ms | other CPU s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        ratio, decode_ratio = (f"{r[k]:.2f}×" if k in r else "" for k in ("ratio", "decode_ratio"))
        lines.append(f"| {r['name']} | {r['output_tokens']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {ratio} "
                     f"| {r['decode_tok_s']:.1f} | {decode_ratio} | {r['finish_reasons']} | {r['median_step_ms']:.1f} "
                     f"| {r['other_cpu_s']:.1f} |")
    lines += ["", "Ratios: constrained over the unconstrained run with the same output lengths (the row above it); "
              "target ≥ 0.85× in output tok/s (wall, prefill included: no prefix cache, so every run prefills "
              "the same). Decode-step tok/s: tokens over time of the steps that prefilled nothing.", ""]
    for name, v in report["validity"].items():
        lines.append(f"- {name}: {v['valid']}/{v['requests']} answers validate against the schema "
                     f"({v['parse']} parse as JSON)")
        lines += [f"  - {kind}: `{text}`" for kind, text in v["examples"].items()]
    lines += ["", "Mask time per engine step (steps with constrained rows), measured inside the constrained runs:", "",
              "| run | part | median ms/step | mean ms/step | µs per row | share of step time |",
              "|---|---|---|---|---|---|"]
    for name, m in report["mask_time"].items():
        for part in ("compute", "apply"):
            p = m[part]
            lines.append(f"| {name} | {part} | {p['median_ms_per_step']:.3f} | {p['mean_ms_per_step']:.3f} | "
                         f"{p['us_per_row']:.1f} | {p['share_of_step']:.2%} |")
        lines.append(f"| {name} | whole step | {m['median_step_ms']:.1f} | | | |")
    lines += ["", "Not in these two: advancing each matcher by its token (consume_token, in the engine's stop "
              "check); the throughput ratio above includes it."]
    stats = report["mask_stats"]
    lines += ["", f"Applying the mask: {report['apply_bitmasks']} bitmasks of the greedy constrained run "
              f"({report['batch']} × {report['vocab']}; median {stats['median_allowed_tokens_per_row']:.0f} "
              f"tokens allowed per row, {stats['words_all_allowed']:.1%} of 32-bit words all allowed, "
              f"{stats['words_none_allowed']:.1%} none) on the same fp32 logits:", "",
              "| method | ms per step | vs fastest | first call s (torch.compile: cached on disk after a first run) "
              "| identical logits |", "|---|---|---|---|---|"]
    for name, a in report["apply"].items():
        if "error" in a:
            lines.append(f"| {name} | failed: {a['error']} | | | |")
        else:
            lines.append(f"| {name} | {a['ms_per_step']:.3f} | {a['vs_fastest']:.1f}× | {a['first_call_s']:.2f} | "
                         f"{a['identical_logits']} |")
    ch = report["choice"]
    lines += ["", f"`choice` over {LABELS}: steps that gave a request a token vs the tokens it generated "
              f"(differ in {ch['steps_differ_from_generated_tokens']} requests: an extra step for the end would "
              f"show here) and vs the label's own tokens (differ in {ch['steps_differ_from_label_tokens']}):", "",
              "| label | label tokens | requests | generated tokens: requests | steps: requests | pieces |",
              "|---|---|---|---|---|---|"]
    for label, e in ch["per_label"].items():
        lines.append(f"| {label} | {e['label_tokens']} | {e['requests']} | {e['generated_tokens']} | {e['steps']} "
                     f"| {' '.join(f'`{piece}`' for piece in e['pieces'])} |")
    comp = report["grammar_compile"]
    lines += ["", f"Grammar: llguidance tokenizer built in {comp['tokenizer_s']:.2f} s, schema compiled in "
              f"{comp['schema_s']:.3f} s, choice in {comp['choice_s']:.3f} s (once per distinct setting).", "",
              "Other processes (cores in use over 1 s):", ""]
    for when in ("start", "end"):
        p = report["other_processes"][when]
        top = "; ".join(f"{b['cpu_s']:.2f} {b['cmd']}" for b in p["busiest"]) or "none"
        lines.append(f"- at {when}: {p['other_cores_in_use']:.2f} cores — {top}")
    lines += ["", "Other processes during each run (CPU s):", ""]
    for r in report["runs"]:
        top = "; ".join(f"{b['cpu_s']:.1f} {b['cmd']}" for b in r["busiest_others"]) or "none"
        lines.append(f"- {r['name']}: {r['other_cpu_s']:.1f} in all — {top}")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    def bars(ax: Any, labels: list[str], values: list[float], unit: str, color: str, title: str) -> None:
        ax.barh([textwrap.fill(label, 22) for label in labels], values, color=color)
        for y, value in enumerate(values):
            ax.annotate(f" {value:.3g}", (value, y), va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_xlim(0, 1.2 * max(values))
        ax.set_title(title, fontsize=10)

    fig, (ax_tok, ax_mask, ax_apply) = plt.subplots(1, 3, figsize=(16, 5))
    runs = report["runs"]
    bars(ax_tok, [r["name"] for r in runs], [r["output_tok_s"] for r in runs], "output tok/s", "tab:blue",
         f"throughput, B={report['batch']}")
    mask_labels, mask_ms = [], []
    for name, m in report["mask_time"].items():
        for part in ("compute", "apply"):
            mask_labels.append(f"{name}: {part} ({m[part]['share_of_step']:.2%} of step)")
            mask_ms.append(m[part]["mean_ms_per_step"])
    bars(ax_mask, mask_labels, mask_ms, "ms per step (mean)", "tab:green",
         f"mask per step (a step: {min(m['median_step_ms'] for m in report['mask_time'].values()):.0f} ms or more)")
    done = {n: a["ms_per_step"] for n, a in report["apply"].items() if "ms_per_step" in a}
    bars(ax_apply, list(done), list(done.values()), "ms per step (median)", "tab:orange",
         f"applying a {report['batch']}×{report['vocab']} bitmask")
    fig.suptitle(report["command"] + (" (QUICK smoke run)" if report["quick"] else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=96, help="for every run; a cut JSON answer is invalid")
    ap.add_argument("--no-sampled", action="store_true", help="skip the sampled (temperature 0.8) runs")
    ap.add_argument("--apply-rounds", type=int, default=3, help="passes over the bitmasks per apply method")
    ap.add_argument("--quick", action="store_true", help="B=8, 24 tokens, greedy only: a smoke run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.no_sampled, args.apply_rounds = 8, 24, True, 1
    command = shlex.join(["python", "benchmarks/structured.py", *sys.argv[1:]])
    print(command, f"\ntorch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    at_start = busiest_now()
    print(f"other processes at start: {at_start}", flush=True)

    # No prefix cache: every run prefills the same prompts afresh, so runs compare like for like
    # (with it, the first run would prefill and the later ones hit the cache).
    llm = LLM(weights=load_weights(None), max_num_seqs=args.batch, enable_prefix_caching=False,
              max_model_len=args.prompt_tokens + args.max_tokens + 16)
    vocab = llm.engine.model_config.vocab_size
    schema = StructuredOutputsParams(json=SCHEMA)
    choice = StructuredOutputsParams(choice=LABELS)
    start = time.perf_counter()
    llm.engine.grammars.ll_tokenizer()
    compile_s = {"tokenizer_s": time.perf_counter() - start}
    for key, setting in (("schema_s", schema), ("choice_s", choice)):
        start = time.perf_counter()
        llm.engine.check_structured_outputs(setting)
        compile_s[key] = time.perf_counter() - start

    prompts = build_prompts(llm, args.batch, args.prompt_tokens, seed=15)
    # Warm-up at the full batch: kernels compiled and loaded, allocator settled; not measured.
    warm = build_prompts(llm, args.batch, args.prompt_tokens, seed=16)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=4, temperature=0,
                 structured_outputs=schema), progress=False)

    print("runs:", flush=True)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=15)
    runs: list[Run] = []
    constrained_runs: dict[str, Run] = {}
    ratios: dict[str, dict[str, float]] = {}  # constrained run -> its tok/s over the matched free run's
    bitmasks: list[np.ndarray] = []
    for mode, params in (("greedy", greedy), ("sampled", sampled)):
        if mode == "sampled" and args.no_sampled:
            continue
        constrained, masks = run(llm, f"JSON schema, {mode}", prompts,
                                 replace(params, structured_outputs=schema), args.batch)
        bitmasks = bitmasks or masks
        baseline, _ = run(llm, f"unconstrained, {mode}, same lengths", prompts, matched(constrained, params),
                          args.batch)
        free, _ = run(llm, f"free text, {mode}, natural stops", prompts, params, args.batch)
        constrained_runs[constrained.name] = constrained
        ratios[constrained.name] = {"ratio": constrained.tok_s / baseline.tok_s,
                                    "decode_ratio": constrained.decode_tok_s / baseline.decode_tok_s}
        print(f"  => {constrained.name}: {ratios[constrained.name]['ratio']:.2f}x the unconstrained run's output "
              f"tok/s (target >= 0.85), {ratios[constrained.name]['decode_ratio']:.2f}x in decode steps", flush=True)
        runs += [baseline, constrained, free]
    choice_run, _ = run(llm, "choice, greedy", prompts,
                        SamplingParams(max_tokens=8, temperature=0, structured_outputs=choice), args.batch)
    summaries = [r.summary() | ratios.get(r.name, {}) for r in [*runs, choice_run]]

    if not bitmasks:
        raise RuntimeError("no full-batch bitmask was collected: is every request failing early?")
    # Evenly spaced over the run: early steps (braces, keys) and late ones (free summary text).
    picked = bitmasks[:: max(1, len(bitmasks) // 40)]
    apply = compare_apply(picked, vocab, args.apply_rounds)
    report = {
        "command": command, "quick": args.quick, "batch": args.batch, "prompt_tokens": args.prompt_tokens,
        "prompt_tokens_actual": sorted({len(p) for p in prompts}), "max_tokens": args.max_tokens, "vocab": vocab,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
        "schema": SCHEMA, "grammar_compile": compile_s, "runs": summaries,
        "validity": {name: validity(r) for name, r in constrained_runs.items()},
        "mask_time": {name: mask_timing(r) for name, r in constrained_runs.items()},
        "mask_stats": mask_stats(picked, vocab), "apply_bitmasks": len(picked), "apply": apply,
        "choice": choice_steps(choice_run, llm),
        "other_processes": {"start": at_start, "end": busiest_now()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(report, indent=1, default=str))
    text = markdown(report)
    (args.out / "structured.md").write_text(text)
    plot(report, args.out / "structured.png")
    print()
    print(text)
    print(f"wrote {args.out / 'structured.json'}, .md and .png")


if __name__ == "__main__":
    main()
