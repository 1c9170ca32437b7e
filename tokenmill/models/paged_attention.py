"""Attention read straight from the paged KV cache (CPU, fp32 queries, an fp32 or fp16 cache), via
small C kernels: decodes (csrc/paged_attention.c) and prefill spans (csrc/prefill_attention.c), built by
tokenmill.models.kernels. Where they do not build, or the device/dtype is not CPU fp32, the model
falls back to gathering blocks and calling SDPA with a mask: the same result, with more memory
traffic (decode) and, for prefill, the masked-out work done as well.
"""

from __future__ import annotations

import torch

from tokenmill.models import kernels

# The prefill kernel's tile holds ROWS = 32 query-head rows (csrc/prefill_attention.c): every query
# head of a KV head's group for at least one query.
MAX_PREFILL_QUERY_GROUP = 32


def _kv_half(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """1 for an fp16 cache, 0 for fp32 (the kernels' `kv_half`); queries are fp32."""
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert q.dtype == torch.float32 and k_cache.dtype in kernels.KERNEL_KV_DTYPES, (q.dtype, k_cache.dtype)
    return int(k_cache.dtype == torch.float16)


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
    kv_half = _kv_half(q, k_cache, v_cache)
    q, tables, lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, kv_heads, heads // kv_heads, head_dim, block_size, tables.shape[1],
        head_dim**-0.5, sliding_window or 0, kv_half, torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            "paged-attention kernel failed: empty context, context longer than its block table, "
            f"head_dim {head_dim} not a multiple of 8 up to 256, or out of memory"
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, heads, D]: the step's queries (rows of several requests; a view is fine)
    out: torch.Tensor,  # [T, heads, D] (heads contiguous): the requests' rows are written, others left
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    first_rows: torch.Tensor,  # [R] int64: each request's first row in q
    num_new: torch.Tensor,  # [R] int64: its rows (its context's last tokens)
    context_lens: torch.Tensor,  # [R] int64
    block_tables: torch.Tensor,  # [R, max_blocks] int64
    sliding_window: int | None = None,
) -> None:
    """Each request's new tokens attend causally (within the window) to its context."""
    lib = kernels.library()
    assert lib is not None, "the CPU kernels did not build (check kernels.supports() first)"
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
    kv_half = _kv_half(q, k_cache, v_cache)
    tables, rows, new, lens = (t.contiguous() for t in (block_tables, first_rows, num_new, context_lens))
    status = lib.paged_prefill_attention(
        q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        rows.data_ptr(), new.data_ptr(), lens.data_ptr(), tables.data_ptr(), len(rows), tables.shape[1], kv_heads,
        heads // kv_heads, head_dim, block_size, head_dim**-0.5, sliding_window or 0, kv_half, torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(
            "prefill-attention kernel failed: a context shorter than its new tokens or longer than its block "
            f"table, a query-head group over {MAX_PREFILL_QUERY_GROUP}, head_dim {head_dim} not a multiple of 8, "
            "or out of memory"
        )
