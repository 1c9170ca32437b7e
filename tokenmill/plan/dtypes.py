"""Storage size and compute class of the data types the planner knows."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError

# int4 is modelled as group-wise quantisation (AWQ/GPTQ style): 4 bits per weight plus one fp16
# scale per group of 128 weights, i.e. 0.5 + 2/128 bytes. Zero points and the per-channel scales
# of fp8/int8 are ignored (well under 1% of the bytes).
INT4_GROUP_SIZE = 128
_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5 + 2.0 / INT4_GROUP_SIZE,
}
WEIGHT_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8", "int4", "native")
KV_DTYPES = ("bf16", "fp16", "fp32", "fp8", "int8")
# "native" = as stored in the model file (a GGUF's real tensor bytes); see ModelSpec.

# Quantised checkpoints (AWQ, GPTQ, fp8 and int8 W8A8 alike) quantise the linear layers of the
# transformer blocks only: the token embedding and the lm_head stay in the 16-bit dtype the model
# was trained in, and engines load them that way (vLLM quantises linear layers, never the
# embedding or, unless asked, the lm_head).
QUANTISED_DTYPES = ("fp8", "int8", "int4")
TABLE_BYTES_WHEN_QUANTISED = 2.0  # bf16/fp16


def dtype_bytes(dtype: str, field: str = "dtype") -> float:
    """Bytes per element of ``dtype``; raises PlanError naming ``field`` if unknown."""
    try:
        return _BYTES[dtype]
    except KeyError:
        raise PlanError(field, f"unknown dtype {dtype!r} (known: {', '.join(_BYTES)})") from None


@dataclass(frozen=True)
class WeightWidths:
    """Stored bytes per parameter by role: quantised checkpoints and GGUF files keep the token
    embedding and the lm_head at another width than the transformer blocks."""

    embedding: float  # the input token table (also the output projection when tied)
    lm_head: float  # an untied output projection
    blocks: float  # everything else: attention, MLPs, experts, routers, norms


def weight_widths(dtype: str) -> WeightWidths:
    """Widths for a uniform ``--weight-dtype``: the embedding and lm_head of a quantised
    checkpoint in 16 bits, everything else at the dtype's width."""
    blocks = dtype_bytes(dtype, "weight_dtype")
    table = TABLE_BYTES_WHEN_QUANTISED if dtype in QUANTISED_DTYPES else blocks
    return WeightWidths(embedding=table, lm_head=table, blocks=blocks)


def compute_class(weight_dtype: str) -> str:
    """The tensor-core precision the matmuls run in for a given weight dtype.

    fp8 and int8 weights are assumed to run as W8A8 on hardware that has such units (the
    optimistic choice, right for a ceiling). int4 and GGUF-style weights are dequantised and
    multiplied in bf16 (W4A16), as the common kernels do. fp32 is also mapped to bf16: on GPUs a
    ceiling may assume tensor cores; on a CPU all classes use the one measured fp32 figure.
    """
    if weight_dtype in ("fp8", "int8"):
        return weight_dtype
    return "bf16"
