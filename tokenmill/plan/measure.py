"""Measure ``this-machine``: GEMM FLOP/s and memory bandwidth with torch, in about a second.

Best-of-N timings, because on a shared machine the noise only ever makes a run slower and the
planner wants the ceiling. On CPU the GEMM is fp32 (what a CPU engine computes in); on CUDA it is
bf16 on the tensor cores. Bandwidth is a large tensor copy counting read + write bytes, sized
well past the last-level cache so it measures DRAM (HBM on a GPU), not cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .hardware import HardwareSpec


def _best_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocation, thread pool start, kernel selection
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def total_ram_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_this_machine(gemm_size: int = 2048, copy_mib: int = 256, reps: int = 5,
                         device: str | None = None) -> HardwareSpec:
    """Measure peak GEMM FLOP/s and copy bandwidth on CPU (or CUDA when available)."""
    import torch

    use_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    dev = torch.device("cuda" if use_cuda else "cpu")
    sync: Callable[[], None] = torch.cuda.synchronize if use_cuda else (lambda: None)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    with torch.no_grad():
        a = torch.randn(gemm_size, gemm_size, device=dev, dtype=dtype)
        b = torch.randn(gemm_size, gemm_size, device=dev, dtype=dtype)
        gemm_s = _best_seconds(lambda: a @ b, reps, sync)
        flops = 2 * gemm_size**3 / gemm_s
        src = torch.ones(copy_mib * 2**20 // 4, device=dev, dtype=torch.float32)
        dst = torch.empty_like(src)
        copy_s = _best_seconds(lambda: dst.copy_(src), reps + 2, sync)
        bandwidth = 2 * src.numel() * 4 / copy_s  # read src + write dst
    if use_cuda:
        props = torch.cuda.get_device_properties(dev)
        memory, what = float(props.total_memory), f"CUDA {props.name}, bf16 GEMM"
    else:
        memory, what = total_ram_bytes(), f"CPU x{torch.get_num_threads()} threads, fp32 GEMM"
    return HardwareSpec(
        name="this-machine", memory_bytes=memory, bandwidth_bytes_per_s=bandwidth,
        bf16_flops=flops, fp8_flops=None, int8_ops=None, price_per_hour=0.0,
        notes=f"measured: {what} {gemm_size}^3 best of {reps}, {copy_mib} MiB copy",
        measured=True)
