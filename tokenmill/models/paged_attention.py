"""Decode attention read straight from the paged KV cache (CPU, fp32), via a small C kernel.

The kernel (csrc/paged_attention.c) is compiled once with the system C compiler and cached
under the tokenmill cache folder; no torch headers, so it builds in about a second. Where no
compiler is found, or the device/dtype is not CPU fp32, the model falls back to gathering
blocks and calling SDPA: the same result, about twice the memory traffic.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from tokenmill.models.loader import cache_root

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# -march=native: the build is cached per CPU (the key includes the CPU flags below).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compile(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)
    return target


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention uses the slower gather + SDPA path")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("paged-attention kernel unavailable (%s): using gather + SDPA", detail)
        return None
    fn = lib.paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int64]
    return lib


def kernel_available() -> bool:
    """Compile (once per process; cached on disk across processes) and report success."""
    global _kernel, _tried
    with _lock:
        if not _tried:
            _kernel, _tried = _load(), True
    return _kernel is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and kernel_available()


def paged_decode_attention(
    q: torch.Tensor,  # [S, heads, D], one query token per sequence
    k_cache: torch.Tensor,  # [blocks, block_size, kv_heads, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    context_lens: torch.Tensor,  # [S] int64: keys at positions < len are attended
    sliding_window: int | None = None,
) -> torch.Tensor:
    assert _kernel is not None, "call kernel_available() first"
    num_seqs, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype == k_cache.dtype == torch.float32
    q, tables, lens = q.contiguous(), block_tables.contiguous(), context_lens.contiguous()
    out = torch.empty_like(q)
    status = _kernel.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), num_seqs, kv_heads, heads // kv_heads, head_dim, block_size, tables.shape[1],
        head_dim**-0.5, sliding_window or 0,
    )
    if status != 0:
        raise RuntimeError(
            "paged-attention kernel failed: empty context, context longer than its block table, "
            f"head_dim {head_dim} not a multiple of 8 up to 256, or out of memory"
        )
    return out
