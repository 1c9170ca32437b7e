"""CPU tensors on 2 MiB pages (Linux transparent huge pages), for what a decode step streams.

Why: a batch-1 decode step reads every weight once, front to back (Gemma 3 270M: 257 MB). On
4 KiB pages the hardware prefetchers stop at every page boundary and each page costs a TLB walk;
the one-row matrix-vector kernel then read Gemma 3's 178 MB output layer at 25 GB/s on 2
threads where the same bytes on 2 MiB pages read at 31.5 (14.7 -> 21.3 GB/s on one thread; in
the same process, alternated). Linux's default is often `madvise`: only memory that asks gets
huge pages, and torch's allocator does not ask. So the weights are copied, once, into one
mapping that asks (madvise MADV_HUGEPAGE), and the runner's logits buffer is made in one. (The KV
cache is not: Gemma 3 at batch 8 after 2,048 tokens decoded no faster with it there, and a huge
page commits 2 MiB at its first write where the cache grows a block at a time.) Where the kernel
gives no huge pages (THP `never`, another OS) such a mapping is plain memory and nothing else
changes.
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor placed in an arena starts on a cache line


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of `nbytes`, starting on a 2 MiB boundary of an anonymous
    mapping that asks for huge pages. Memory is committed as it is first written, as with
    torch.empty."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without THP: plain pages
            mapping.madvise(advice)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on huge pages where it is big enough to span one; else torch.empty."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    return huge_page_bytes(nbytes).view(dtype).view(shape)


def move_to_huge_pages(module: nn.Module) -> int:
    """Copy the CPU weights of `module` (its state dict: parameters and persistent buffers, not
    tables made at load such as RoPE's, of which a step reads a few rows) into one huge-page
    arena, in place (through nn.Module._apply, so modules that keep pointers refresh them).
    Tensors that share memory (tied weights, views) still share it afterwards. Returns the bytes
    moved (0 when there is too little to fill a huge page)."""
    weights = module.state_dict(keep_vars=True).values()
    tensors = [t for t in weights if isinstance(t, torch.Tensor) and _movable(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    offsets, total = {}, 0
    for ptr, storage in storages.items():
        offsets[ptr] = total
        total += -(-storage.nbytes() // _ALIGN) * _ALIGN
    if total < HUGE_PAGE:
        return 0
    arena = huge_page_bytes(total)
    for ptr, storage in storages.items():
        arena[offsets[ptr] : offsets[ptr] + storage.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    moved: dict[int, torch.Tensor] = {}
    for t in tensors:
        byte_offset = arena.storage_offset() + offsets[t.untyped_storage().data_ptr()]
        start = byte_offset // t.element_size() + t.storage_offset()
        moved[id(t)] = torch.empty(0, dtype=t.dtype).set_(arena.untyped_storage(), start, t.shape, t.stride())
    # _apply may meet a tensor twice (a module reachable by two paths): the second time it is
    # already moved, and not in `moved`.
    module._apply(lambda t: moved.get(id(t), t))
    return total


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.untyped_storage().nbytes() > 0  # not oneDNN's
