"""Decode attention read straight from the paged KV cache (CPU, fp32), via a small C kernel.

The kernel is csrc/paged_attention.c (built by tokenmill.models.kernels). Where it does not
build, or the device/dtype is not CPU fp32, the model falls back to gathering blocks and calling
SDPA: the same result, about twice the memory traffic.
"""

from __future__ import annotations

import torch

from tokenmill.models import kernels


def paged_decode_attention(
    q: torch.Tensor,  # [S, heads, D], one query token per sequence
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    context_lens: torch.Tensor,  # [S] int64: keys at positions < len are attended
    sliding_window: int | None = None,
) -> torch.Tensor:
    lib = kernels.library()
    assert lib is not None, "the CPU kernels did not build (check kernels.supports() first)"
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == k_cache.dtype == torch.float32
    q, tables, lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, kv_heads, heads // kv_heads, head_dim, block_size, tables.shape[1],
        head_dim**-0.5, sliding_window or 0, torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            "paged-attention kernel failed: empty context, context longer than its block table, "
            f"head_dim {head_dim} not a multiple of 8 up to 256, or out of memory"
        )
    return out
