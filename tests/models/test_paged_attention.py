"""The paged attention kernels against gather + SDPA on the same cache, fp32 and fp16 (the
reference reads the fp16 cache converted to fp32: the kernels must agree to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models import kernels, paged_attention

CPU = torch.device("cpu")
CACHE_DTYPES = pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def _reference(q, k_cache, v_cache, tables, lens, window):  # type: ignore[no-untyped-def]
    n, heads, d = q.shape
    kvh = k_cache.shape[2]
    kg = k_cache[tables.flatten()].view(n, -1, kvh, d).transpose(1, 2)
    vg = v_cache[tables.flatten()].view(n, -1, kvh, d).transpose(1, 2)
    pos = torch.arange(kg.shape[2])
    keep = pos[None, :] < lens[:, None]
    if window:
        keep &= pos[None, :] >= lens[:, None] - window
    group = heads // kvh
    mask = keep[:, None, None, :].expand(n, 1, group, -1)
    out = F.scaled_dot_product_attention(q.view(n, kvh, group, d), kg.float(), vg.float(), attn_mask=mask)
    return out.reshape(n, heads, d)


@CACHE_DTYPES
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size", "window"),
    # Query heads are attended up to 4 at a time: groups of 5-8 take two passes; head_dim 64, 128 and
    # 256 have kernels of their own, others (16, 24, 32) the general one.
    [(2, 2, 16, 4, None), (3, 3, 64, 16, None), (1, 8, 32, 8, None), (2, 1, 16, 4, 9), (1, 4, 256, 16, None),
     (1, 7, 128, 16, None), (2, 5, 24, 8, 5), (1, 6, 256, 16, 40)],
)
def test_kernel_matches_gather_and_sdpa(kv_heads: int, group: int, head_dim: int, block_size: int, window: int | None,
                                        cache_dtype: torch.dtype) -> None:
    assert kernels.supports(CPU, torch.float32), "the C kernel must build where CI runs (gcc is there)"
    gen = torch.Generator().manual_seed(0)
    num_blocks, seqs, max_blocks = 64, 6, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    # Scattered, non-contiguous block tables; lengths from 1 token to every block full.
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks)
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5, max_blocks * block_size])
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=gen)
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, window)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, window), atol=1e-5, rtol=1e-5)


def test_kernel_reads_only_the_context() -> None:
    """Positions past a sequence's length (stale or NaN memory) must not reach the output."""
    assert kernels.supports(CPU, torch.float32)
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, 4, 1, 8, generator=gen)
    v_cache = torch.randn(4, 4, 1, 8, generator=gen)
    k_cache[2, 1:] = v_cache[2, 1:] = float("nan")  # past the end of a 9-token context
    tables = torch.tensor([[0, 1, 2]])
    q = torch.randn(1, 2, 8, generator=gen)
    got = paged_attention.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([9]))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _reference(q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables,
                                                torch.tensor([9]), None), atol=1e-5, rtol=1e-5)


def test_an_empty_context_is_an_error_not_garbage() -> None:
    assert kernels.supports(CPU, torch.float32)
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="empty context"):
        paged_attention.paged_decode_attention(q, cache, cache, torch.tensor([[0]]), torch.tensor([0]))


@CACHE_DTYPES
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("kv_heads", "window"), [(1, None), (3, None), (1, 700)])
@pytest.mark.parametrize("group", [3, 6])
def test_few_long_contexts_are_split_across_threads(threads: int, kv_heads: int, window: int | None, group: int,
                                                    cache_dtype: torch.dtype) -> None:
    """Batch 1-2: too few (sequence, KV head) items for the threads, so each long context is
    attended in parts merged by their scores' maxima and totals (one sequence far shorter than
    the other: parts past its end are empty; one not a whole number of blocks), and a context too
    short to split has its query heads split between tasks (3: 2 + 1 at 2 threads; 6: 3 + 3)."""
    assert kernels.supports(CPU, torch.float32)
    gen = torch.Generator().manual_seed(2)
    block_size, head_dim, max_blocks = 16, 64, 160
    k_cache = torch.randn(2 * max_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(2 * max_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tables = torch.randperm(2 * max_blocks, generator=gen).view(2, max_blocks)
    q = torch.randn(2, kv_heads * group, head_dim, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens in (torch.tensor([2_500]), torch.tensor([2_557, 300]), torch.tensor([200]), torch.tensor([300, 40])):
            n = len(lens)
            got = paged_attention.paged_decode_attention(q[:n], k_cache, v_cache, tables[:n], lens, window)
            want = _reference(q[:n], k_cache, v_cache, tables[:n], lens, window)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


def _prefill_reference(q, k_cache, v_cache, first_rows, num_new, lens, tables, window):  # type: ignore[no-untyped-def]
    """Each request's rows of q against its gathered context, causal and windowed, one at a time."""
    heads, d = q.shape[1:]
    kvh = k_cache.shape[2]
    out = torch.zeros_like(q)
    for row, n, ctx, table in zip(first_rows.tolist(), num_new.tolist(), lens.tolist(), tables, strict=True):
        k = k_cache[table].float().reshape(-1, kvh, d)[:ctx].repeat_interleave(heads // kvh, dim=1).transpose(0, 1)
        v = v_cache[table].float().reshape(-1, kvh, d)[:ctx].repeat_interleave(heads // kvh, dim=1).transpose(0, 1)
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1), k, v, attn_mask=mask)
        out[row:row + n] = o.transpose(0, 1)
    return out


@CACHE_DTYPES
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size", "window"),
    [(3, 3, 64, 16, None), (1, 4, 256, 16, 40), (2, 1, 16, 4, None), (1, 8, 32, 8, 7), (2, 5, 16, 4, None)],
)
def test_prefill_kernel_matches_masked_sdpa(kv_heads: int, group: int, head_dim: int, block_size: int,
                                            window: int | None, cache_dtype: torch.dtype) -> None:
    """Requests of 2-70 new tokens after 0-45 tokens already in their context (chunked prefill),
    their rows apart in a strided q (a view of the fused qkv output), rows of other requests left
    alone; tiles of 32 query-head rows (group 5: 6 queries, 2 padding rows)."""
    assert kernels.supports(CPU, torch.float32)
    gen = torch.Generator().manual_seed(3)
    heads, max_blocks = kv_heads * group, 32
    k_cache = torch.randn(4 * max_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(4 * max_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    num_new = torch.tensor([70, 2, 33, 9])
    lens = num_new + torch.tensor([0, 45, 17, 1])
    first_rows = torch.tensor([0, 75, 80, 120])  # rows 70-74, 77-79 and 113-119 belong to no request
    tables = torch.randperm(4 * max_blocks, generator=gen).view(4, max_blocks)
    qkv = torch.randn(130, heads + 2 * kv_heads, head_dim, generator=gen)
    q = qkv[:, :heads]
    out = torch.full((130, heads, head_dim), 7.0)
    paged_attention.paged_prefill_attention(q, out, k_cache, v_cache, first_rows, num_new, lens, tables, window)
    want = _prefill_reference(q, k_cache, v_cache, first_rows, num_new, lens, tables, window)
    mine = torch.zeros(130, dtype=torch.bool)
    for row, n in zip(first_rows.tolist(), num_new.tolist(), strict=True):
        mine[row:row + n] = True
    torch.testing.assert_close(out[mine], want[mine], atol=1e-5, rtol=1e-5)
    assert (out[~mine] == 7.0).all(), "rows of no request were written"
