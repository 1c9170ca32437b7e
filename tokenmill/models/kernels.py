"""The CPU kernels in csrc/, compiled once with the system C compiler and loaded with ctypes.

No torch headers and no build system: one `cc` call builds every csrc/*.c file into one shared
library in about a second, cached under the tokenmill cache folder per source, compiler and
CPU. OpenMP comes from the libgomp torch already loaded, so the process keeps one thread pool.
Where no compiler is found or the build fails, `library()` is None and callers use PyTorch ops.
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

from tokenmill.environment import cache_root

log = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).with_name("csrc")).glob("*.c"))
_HEADERS = sorted((Path(__file__).with_name("csrc")).glob("*.h"))
# -march=native: the build is cached per CPU (the key includes the CPU flags below).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# Each exported kernel's arguments (every one returns an int status), as csrc/ declares them: checked against
# the C prototypes by tests/models/test_kernel_signatures.py.
SIGNATURES = {
    "paged_decode_attention": [_P] * 6 + [_I] * 6 + [_F, _I64, _I, _I],
    "paged_prefill_attention": [_P, _I64, _P, _I64] + [_P] * 6 + [_I] * 6 + [_F, _I64, _I, _I],
    "encoder_attention": [_P] * 3 + [_I] * 3 + [_F, _I],
    "small_gemm": [_P] * 4 + [_I] * 4,
    "apply_token_bitmask": [_P, _P, _I, _I, _I],
    "quant_linear": [_P, _P, _P, _I, _I],
    "quant_linear_available": [],
    "quant_rows": [_P, _P, _I, _P],
    "rms_norm": [_P, _P, _P, _I, _I, _F, _F, _I],
    "rope_inplace": [_P, _P, _P, _I, _I, _I, _I, _I64, _I],
    "gated_activation": [_P, _P, _I, _I, _I, _I],
    "decode_layers": [_P, _P, _P, _I] + [_P] * 7 + [_I],
}


class QuantLinear(ctypes.Structure):
    """csrc/team.h's QuantLinear: a quantised linear layer's shape and buffers."""

    _fields_ = [("bits", _I), ("out_features", _I), ("in_features", _I), ("scale_format", _I),
                ("weight", _P), ("scale", _P), ("min", _P), ("bias", _P), ("next", _P)]


class DecodeLayer(ctypes.Structure):
    """csrc/decode_layers.c's DecodeLayer: one decoder layer's weights and KV cache."""

    _fields_ = [("input_norm", _P), ("post_attention_norm", _P), ("q_norm", _P), ("k_norm", _P),
                ("ffn_norm", _P), ("post_ffn_norm", _P), ("qkv", QuantLinear), ("o", QuantLinear),
                ("gate_up", QuantLinear), ("down", QuantLinear), ("k_cache", _P), ("v_cache", _P),
                ("window", _I64), ("local_rope", _I)]


class DecodeShape(ctypes.Structure):
    """csrc/decode_layers.c's DecodeShape."""

    _fields_ = [(name, _I) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "rotary",
                                        "intermediate", "block_size", "max_blocks")] + \
               [("eps", _F), ("attention_scale", _F), ("norm_offset", _F), ("activation", _I), ("q_scale", _F),
                ("kv_half", _I)]


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compile(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    flags = [*_FLAGS, *extra_flags]
    digest = hashlib.sha256(" ".join([compiler, *flags, _cpu_signature()]).encode())
    for source in _SOURCES + _HEADERS:
        digest.update(source.name.encode() + source.read_bytes())
    target = cache_root() / "kernels" / f"tokenmill-kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", str(built), "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, target)
    return target


def _load(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels are off (slower PyTorch fallbacks)")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler, extra_flags)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("CPU kernels unavailable (%s): using PyTorch fallbacks", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """Compile (once per process; cached on disk across processes) and load; None on failure."""
    global _library, _tried
    if _tried:  # every kernel call comes here: no lock once the library is settled
        return _library
    with _lock:
        if not _tried:
            _library, _tried = _load(), True
    return _library


def variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The kernels built with more compiler flags, loaded beside library(): how tests and benchmarks
    run a path this CPU would not take, e.g. ("-mno-avx512vnni",) for the AVX2 GEMM on a VNNI CPU."""
    return _load(extra_flags)


# csrc/team.h's activations of gated_activation, by transformers' hidden_act name.
GATED_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


# The KV-cache elements the attention kernels read (and the decode stack writes).
KERNEL_KV_DTYPES = (torch.float32, torch.float16)


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Can the kernels run on tensors of this device and dtype (CPU, fp32, built)?"""
    return device.type == "cpu" and dtype == torch.float32 and library() is not None
