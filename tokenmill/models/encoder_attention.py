"""The encoder's attention read in place from packed q/k/v rows (csrc/encoder_attention.c): every
token attends to its own sequence, with no padded copy of the batch. Where the kernels do not build
(or the device or dtype is not CPU fp32), models/encoder.py pads and calls SDPA: the same result."""

from __future__ import annotations

import torch

from tokenmill.models import kernels


def packed_attention(qkv: torch.Tensor, starts: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, 3 · heads · head_dim] (q, k, v side by side), starts [B + 1] int64 (sequence i is rows
    starts[i]..starts[i + 1]) → [T, heads · head_dim]."""
    lib = kernels.library()
    assert lib is not None, "the CPU kernels did not build (check kernels.supports() first)"
    assert qkv.dtype == torch.float32 and qkv.is_contiguous() and starts.dtype == torch.int64
    out = torch.empty(qkv.shape[0], heads * head_dim)
    status = lib.encoder_attention(qkv.data_ptr(), out.data_ptr(), starts.data_ptr(), starts.numel() - 1, heads,
                                   head_dim, head_dim**-0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"encoder-attention kernel failed: an empty sequence, head_dim {head_dim} not a "
                           "multiple of 8, or out of memory")
    return out
