"""Decode attention: the paged kernel vs gather + SDPA, on one layer and on whole engine steps.

    python benchmarks/paged_attention.py [--batch 64] [--context 320]

Prints times and the ratio measured in the same run, and the CPU other processes used meanwhile
(a busy machine makes both numbers meaningless).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms, step_ms

from tokenmill.bench.runner import CpuMeter
from tokenmill.engine import EngineConfig, LLMEngine, SamplingParams
from tokenmill.models import kernels, paged_attention
from tokenmill.models.loader import load_weights


def one_layer(batch: int, context: int) -> None:
    kv_heads, group, head_dim, block_size = 3, 3, 64, 16  # SmolLM2-135M's attention shape
    blocks = -(-context // block_size)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch * blocks + 1, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks, generator=gen).view(batch, blocks)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen)
    mask = (torch.arange(blocks * block_size) < context)[None, None, None, :]

    def gather_sdpa() -> torch.Tensor:
        kg = k_cache.index_select(0, tables.flatten()).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        vg = v_cache.index_select(0, tables.flatten()).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(batch, kv_heads, group, head_dim), kg, vg, attn_mask=mask)

    def kernel() -> torch.Tensor:
        return paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens)

    torch.testing.assert_close(kernel(), gather_sdpa().reshape(batch, -1, head_dim), atol=1e-5, rtol=1e-5)
    meter = CpuMeter()
    sdpa_ms, kernel_ms = median_ms(gather_sdpa), median_ms(kernel)
    mb = 2 * batch * context * kv_heads * head_dim * 4 / 1e6
    print(f"one layer, batch {batch} x {context} tokens ({mb:.0f} MB of K/V): gather+SDPA {sdpa_ms:.2f} ms, "
          f"kernel {kernel_ms:.2f} ms = {sdpa_ms / kernel_ms:.2f}x  [other CPU {meter.other_seconds()} s]")


def engine_steps(batch: int, prompt_len: int) -> None:
    weights = load_weights(None)
    engines = {}
    for mode in ("kernel", "sdpa"):
        engine = LLMEngine(EngineConfig(max_num_seqs=batch, max_model_len=prompt_len + 128,
                                        decode_attention=mode), weights=weights)
        gen = torch.Generator().manual_seed(0)
        for _ in range(batch):
            prompt = torch.randint(100, 40000, (prompt_len,), generator=gen).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        while engine.stats().prefill_tokens < batch * prompt_len:
            engine.step()
        engines[mode] = engine
    meter = CpuMeter()
    ms = step_ms(engines, rounds=4, steps=4)
    k, s = ms["kernel"], ms["sdpa"]
    print(f"decode step, batch {batch}, {prompt_len}-token prompts: gather+SDPA {s:.0f} ms, "
          f"kernel {k:.0f} ms = {s / k:.2f}x  [other CPU {meter.other_seconds()} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=320)
    args = ap.parse_args()
    if args.context <= 64:  # the engine part decodes from prompts of context - 64 tokens
        ap.error(f"--context must be > 64, got {args.context}")
    if not kernels.supports(torch.device("cpu"), torch.float32):
        raise SystemExit("the paged-attention kernel did not build (see the log)")
    one_layer(args.batch, args.context)
    engine_steps(args.batch, args.context - 64)


if __name__ == "__main__":
    main()
