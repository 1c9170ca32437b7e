"""The paged decode-attention kernel against gather + SDPA on the same cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.models import kernels, paged_attention

CPU = torch.device("cpu")


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
    out = F.scaled_dot_product_attention(q.view(n, kvh, group, d), kg, vg, attn_mask=mask)
    return out.reshape(n, heads, d)


@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "block_size", "window"),
    [(2, 2, 16, 4, None), (3, 3, 64, 16, None), (1, 8, 32, 8, None), (2, 1, 16, 4, 9)],
)
def test_kernel_matches_gather_and_sdpa(kv_heads: int, group: int, head_dim: int, block_size: int, window: int | None) -> None:  # noqa: E501
    assert kernels.supports(CPU, torch.float32), "the C kernel must build where CI runs (gcc is there)"
    gen = torch.Generator().manual_seed(0)
    num_blocks, seqs, max_blocks = 64, 6, 7
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
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
