"""The prefill attention kernel: alone, GMAC/s on the work attention needs (each query against the
keys its causal / window bounds let in) for the real models' layer shapes; then whole prefills of
2 x 2,048-token prompts on both real models with `prefill_attention` kernel vs sdpa (gather + masked
SDPA in 128-query chunks), in alternating rounds of one run, median of the rounds.

    python benchmarks/prefill_attention.py [--tokens 2048] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.runner import CpuMeter
from tokenmill.environment import named_model_path
from tokenmill.models import paged_attention

# (name, KV heads, query heads per KV head, head_dim, window): the real models' layers.
SHAPES = [("SmolLM2-135M", 3, 3, 64, None), ("Gemma 3 270M global", 1, 4, 256, None),
          ("Gemma 3 270M sliding", 1, 4, 256, 512)]
BLOCK = 16


def kernel_alone(n: int, reps: int = 3) -> None:
    for name, kvh, group, d, window in SHAPES:
        blocks = -(-n // BLOCK)
        k_cache, v_cache = torch.randn(blocks, BLOCK, kvh, d), torch.randn(blocks, BLOCK, kvh, d)
        q = torch.randn(n, kvh * group, d)
        out = torch.empty_like(q)
        args = (q, out, k_cache, v_cache, torch.tensor([0]), torch.tensor([n]), torch.tensor([n]),
                torch.arange(blocks)[None], window)
        paged_attention.paged_prefill_attention(*args)
        start = time.perf_counter()
        for _ in range(reps):
            paged_attention.paged_prefill_attention(*args)
        seconds = (time.perf_counter() - start) / reps
        gmac = sum(min(i + 1, window or n) for i in range(n)) * kvh * group * d * 2 / 1e9
        print(f"kernel alone, {name:22s} {n} tokens: {seconds * 1e3:6.1f} ms, {gmac / seconds:5.1f} GMAC/s", flush=True)


def whole_prefill(model: str, n: int, rounds: int, threads: int) -> None:
    path = str(named_model_path(model))
    llms = {mode: LLM(path, enable_prefix_caching=False, num_threads=threads, prefill_attention=mode)
            for mode in ("kernel", "sdpa")}
    prompts = [{"prompt_token_ids": [1000 + (i * 7919 + j * 31) % 20000 for i in range(n)]} for j in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0)
    for llm in llms.values():
        llm.generate(prompts[:1], params, progress=False)  # warm-up
    seconds: dict[str, list[float]] = {mode: [] for mode in llms}
    meter = CpuMeter()
    for _ in range(rounds):
        for mode, llm in llms.items():
            start = time.perf_counter()
            llm.generate(prompts, params, progress=False)
            seconds[mode].append(time.perf_counter() - start)
    kernel, sdpa = (statistics.median(seconds[m]) for m in ("kernel", "sdpa"))
    print(f"whole prefill, {model:12s} 2 x {n} tokens: kernel {2 * n / kernel:6.0f} tok/s, sdpa {2 * n / sdpa:6.0f} "
          f"tok/s: {sdpa / kernel:.2f}x (median of {rounds}; other processes {meter.other_seconds()} CPU-s)",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel_alone(args.tokens)
    for model in ("smollm2", "gemma3-270m"):
        whole_prefill(model, args.tokens, args.rounds, args.threads)


if __name__ == "__main__":
    main()
