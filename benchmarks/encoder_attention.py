"""The encoder's attention kernel (csrc/encoder_attention.c) against the SDPA path it replaces
(pad the packed batch, SDPA with a key mask, gather back), on batches of all-MiniLM-L6-v2's shape
(12 heads of 32) and the lengths sorted windows produce: what KERNEL_LONGEST in models/encoder.py
is set from.

    python benchmarks/encoder_attention.py [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from tokenmill.models.encoder import Attention, PackedBatch
from tokenmill.models.encoder_attention import packed_attention
from tokenmill.models.encoder_config import EncoderConfig

HEADS, HEAD_DIM = 12, 32
# (batch, shortest, longest): about 1,000-2,000 tokens each, from short inputs to long ones.
SHAPES = [(120, 5, 20), (60, 20, 40), (30, 40, 70), (22, 80, 100), (16, 100, 130), (15, 120, 140), (8, 250, 250)]


def best_of(fn: Callable[[], object], repeats: int = 7, calls: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    torch.set_num_threads(parser.parse_args().threads)
    shape = EncoderConfig(vocab_size=1, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=1, num_attention_heads=HEADS,
                          intermediate_size=1, max_position_embeddings=512, type_vocab_size=1, layer_norm_eps=1e-12,
                          hidden_act="gelu", pad_token_id=0)
    sdpa = Attention(shape)
    rng = random.Random(0)
    print("| batch | lengths | kernel ms | SDPA ms | kernel speed-up | max abs difference |\n|---|---|---|---|---|---|")
    for count, low, high in SHAPES:
        lengths = [rng.randint(low, high) for _ in range(count)]
        batch = PackedBatch(torch.zeros(sum(lengths), dtype=torch.long), lengths)
        qkv = torch.randn(sum(lengths), 3 * HEADS * HEAD_DIM)
        kernel = best_of(lambda: packed_attention(qkv, batch.starts, HEADS, HEAD_DIM))  # noqa: B023
        padded = best_of(lambda: sdpa.padded_sdpa(qkv, batch))  # noqa: B023
        kernel_out, sdpa_out = packed_attention(qkv, batch.starts, HEADS, HEAD_DIM), sdpa.padded_sdpa(qkv, batch)
        error = (kernel_out - sdpa_out).abs().max().item()
        print(f"| {count} | {low}-{high} | {kernel * 1e3:.2f} | {padded * 1e3:.2f} | {padded / kernel:.2f}x | "
              f"{error:.1e} |")


if __name__ == "__main__":
    main()
