"""Weights kept quantised in memory: blocks of 32 along the input dimension, run by
csrc/quant_gemm.c.

Four formats, each with a scale per block (and, for 4 bits, a minimum where the source has one):
- q8: value = scale · q, q in [-127, 127] (llama.cpp's Q8_0);
- q5: value = scale · q, q in [-16, 15] (llama.cpp's Q5_0; fits q8 exactly, so mixed with 8-bit
  parts in a fused projection it simply becomes 8 bits);
- q4: value = scale · q + min, q in [0, 15] (Q4_1 and Q4_K's sub-blocks fit exactly), or without
  minimums value = scale · q, q in [-8, 7] (Q4_0: its min would always be -8 · scale; it fits q8
  exactly as q5 does);
- q6: value = scale · q, q in [-32, 31], with a scale for each half block of 16 (llama.cpp's
  Q6_K, whose scales are int8 multiples of a factor per super-block of 256).
A GGUF's blocks of those types become these without a round trip through fp32; anything else
(fp32/bf16 weights, other GGUF types) is quantised from fp32 at load (`quantize`, 4 or 8 bits).
The kernel reads the block values in fp16 where that holds them exactly (Q4_0, Q4_1, Q8_0), as
Q4_K's or Q6_K's own factors where they came from one (`SuperBlockValues`), else in fp32.

`Quantized` is the unpacked form the loader hands over (one value per byte, rows in the
Hugging Face order, so q/k rows can be permuted and q/k/v concatenated like fp32 weights).
`QuantizedLinear` packs it once into the kernel's layout.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.models import kernels
from tokenmill.models.weight_formats import WEIGHT_FORMATS as WEIGHT_FORMATS  # its old home

BLOCK = 32
HALF_BLOCK = 16  # the k values a 6-bit scale covers: csrc/team.h's SUB_BLOCK(6)
Q4_OFFSET = 8  # 4 bits without minimums are stored as q + 8: csrc/team.h's Q4_OFFSET
Q6_OFFSET = 32  # 6 bits are stored as q + 32: csrc/team.h's Q6_OFFSET
SUPER_BLOCK = 256  # a k-quant's: csrc/team.h's SUPER_BLOCK
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
_FIVE_BIT = ("Q5_0",)
_SIX_BIT = ("Q6_K",)
_EIGHT_BIT = ("Q8_0",)
# The GGUF types from_gguf_blocks maps exactly, by the bits it keeps them in.
_EXACT = {4: _FOUR_BIT, 5: _FIVE_BIT, 6: _SIX_BIT, 8: _EIGHT_BIT}
# Those whose blocks are scale · q, no minimums: they widen to 8-bit blocks exactly.
_WIDEN_EXACTLY = ("Q4_0", "Q5_0")
_FLOAT = ("F32", "F16", "BF16", "F64")
# Weights read by a token id, or producing the logits: kept at 8 bits under q4 (as llama.cpp's
# 4-bit presets keep the output layer wider) unless the file already has them in 4 bits.
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class SuperBlockValues:
    """Block values (scales or minimums) as a k-quant holds them: an fp16 factor per super-block
    of 256 times a small integer per block (Q4_K's 6-bit ones) or half block (Q6_K's int8 ones),
    each product exact in fp32 and not, in general, in fp16."""

    factor: torch.Tensor  # fp16 [N, K / 256]
    multiple: torch.Tensor  # uint8 [N, K / 32], or int8 [N, K / 16]

    def values(self) -> torch.Tensor:
        """fp32, one a multiple."""
        per_super = self.multiple.shape[1] // self.factor.shape[1]
        return self.factor.float().repeat_interleave(per_super, dim=-1) * self.multiple.float()

    def permute_rows(self, order: torch.Tensor) -> SuperBlockValues:
        return SuperBlockValues(self.factor[order], self.multiple[order])

    @staticmethod
    def cat(parts: list[SuperBlockValues]) -> SuperBlockValues:
        return SuperBlockValues(torch.cat([p.factor for p in parts]), torch.cat([p.multiple for p in parts]))


@dataclass
class Quantized:
    """A [N, K] weight: q [N, K], uint8 for 4 bits with minimums, else int8 (value = scale · q);
    scale (and min, 4 bits only) fp32 [N, K / 32], at 6 bits [N, K / 16]; from a k-quant (Q4_K,
    Q6_K), `factors` are the same scale (and min) as that file's super-block factors
    (SuperBlockValues), which the kernel reads instead."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None
    factors: tuple[SuperBlockValues, SuperBlockValues | None] | None = None  # scale, min

    @property
    def shape(self) -> tuple[int, int]:  # (out_features N, in_features K)
        return (self.q.shape[0], self.q.shape[1])

    @property
    def sub_block(self) -> int:
        """k values one scale covers: csrc/team.h's SUB_BLOCK."""
        return HALF_BLOCK if self.bits == 6 else BLOCK

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        blocks = self.q.reshape(n, k // self.sub_block, self.sub_block).float() * self.scale[..., None]
        if self.min is not None:
            blocks = blocks + self.min[..., None]
        return blocks.reshape(n, k)

    def permute_rows(self, order: torch.Tensor) -> Quantized:
        factors = None
        if self.factors is not None:
            scale, low = self.factors
            factors = (scale.permute_rows(order), None if low is None else low.permute_rows(order))
        return Quantized(self.bits, self.q[order], self.scale[order], None if self.min is None else self.min[order],
                         factors)

    def exactly_as(self, bits: int) -> Quantized | None:
        """The same values in `bits`-bit blocks where no rounding is needed (blocks without
        minimums, a scale a block, widen to 8 as they are), else None."""
        if bits == self.bits:
            return self
        widens = bits == 8 and self.min is None and self.sub_block == BLOCK
        return Quantized(8, self.q, self.scale) if widens else None


@dataclass
class QuantizedParts:
    """A fused weight (q/k/v, gate/up) stacked along N from parts in different formats, each kept
    in its own (Q4_K_M's q/k/v where v is Q6_K; Gemma 3's where q, k are Q5_0 and v Q8_0): meeting
    in one format would widen the narrow parts, or requantise them."""

    parts: tuple[Quantized, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


# A state dict's value once the loader may keep blocks (and, once projections are fused, parts).
Weight = torch.Tensor | Quantized | QuantizedParts


def target_bits(setting: str, name: str, source_type: str, ndim: int = 2) -> int | None:
    """The bits a weight is kept in under `setting` (None: fp32). `source_type`: its GGUF type name
    ("Q4_K", "F16", ...), "F32" for safetensors weights. auto keeps a quantised file quantised:
    4-bit types in 4 bits, Q5_0 in 5, Q6_K in 6 and Q8_0 in 8 (all exactly), other types (Q5_1,
    Q5_K...) in 8 (requantised)."""
    if setting == "fp32" or ndim != 2 or not (name.endswith("_proj.weight") or name in EMBEDDING_NAMES):
        return None
    if setting == "auto":
        if source_type in _FLOAT:
            return None
        return next((bits for bits, types in _EXACT.items() if source_type in types), 8)
    if setting == "q4" and (name not in EMBEDDING_NAMES or source_type in _FOUR_BIT):
        return 4
    return 8


def held_as(setting: str, name: str, source_type: str, shape: tuple[int, ...]) -> str:
    """How the loader keeps a tensor of this GGUF type under `setting` (shape innermost first, as
    GGUF gives it): its own blocks, blocks requantised from fp32 values, or fp32."""
    bits = target_bits(setting, name, source_type, len(shape))
    if bits is None or not fits_kernel(*reversed(shape)):
        return source_type if source_type == "F32" else f"fp32 (dequantised from {source_type})"
    if source_type in _EXACT[bits]:
        return f"{bits}-bit blocks, as in the file"
    if bits == 8 and source_type in _WIDEN_EXACTLY:
        return f"8-bit blocks (widened exactly from {source_type})"
    return f"{bits}-bit blocks (requantised from {source_type})"


def quantize_linear_weights(state: dict[str, Weight], setting: str) -> dict[str, Weight]:
    """fp32 linear weights quantised as `setting` asks (weights from a safetensors folder, or a
    GGUF's float tensors); shapes the kernel cannot take stay fp32."""
    out = dict(state)
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            bits = target_bits(setting, name, "F32", tensor.dim())
            if bits is not None and fits_kernel(*tensor.shape):
                out[name] = quantize(tensor, bits)
    return out


def quantize(weight: torch.Tensor, bits: int) -> Quantized:
    """Round-to-nearest blocks of 32: symmetric for 8 bits (Q8_0), for 5 bits the block's value of
    largest magnitude at -16 (Q5_0's grid, -16..15: its scale may be negative), min/max for 4 bits
    (Q4_1)."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if bits in (5, 8):
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))[..., 0]
        scale = extreme.abs() / 127 if bits == 8 else extreme / -16
        low, high = (-127, 127) if bits == 8 else (-16, 15)
        q = torch.round(blocks / torch.where(scale != 0, scale, 1)[..., None]).clamp(low, high)
        return Quantized(bits, q.to(torch.int8).reshape(n, k), scale)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = (high - low) / 15
    q = torch.round((blocks - low[..., None]) / torch.where(scale > 0, scale, 1)[..., None]).clamp(0, 15)
    return Quantized(4, q.to(torch.uint8).reshape(n, k), scale, low)


def concatenate(parts: list[Quantized]) -> Quantized | QuantizedParts:
    """Stacked along N (fused q/k/v or gate/up): adjacent parts of one format as one Quantized, and
    parts of several formats as QuantizedParts."""
    runs: list[list[Quantized]] = []
    for part in parts:
        if runs and _format(runs[-1][0]) == _format(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    stacked = tuple(_stack(run) for run in runs)
    return stacked[0] if len(stacked) == 1 else QuantizedParts(stacked)


def _format(w: Quantized) -> tuple[int, bool, tuple[torch.dtype, ...] | None]:
    """What parts must share to be one Quantized: bits, minimums or not, and super-block factors
    of one kind or none."""
    factors = None if w.factors is None else tuple(f.multiple.dtype for f in w.factors if f is not None)
    return (w.bits, w.min is None, factors)


def _stack(parts: list[Quantized]) -> Quantized:
    if len(parts) == 1:
        return parts[0]
    mins, factors = [p.min for p in parts], [p.factors for p in parts]
    scale_factors, min_factors = [f[0] for f in factors if f], [f[1] for f in factors if f and f[1] is not None]
    return Quantized(
        parts[0].bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
        None if mins[0] is None else torch.cat([m for m in mins if m is not None]),
        None if factors[0] is None else (SuperBlockValues.cat(scale_factors),
                                         SuperBlockValues.cat(min_factors) if min_factors else None),
    )


def fits_kernel(out_features: int, in_features: int) -> bool:
    return out_features % 8 == 0 and in_features % BLOCK == 0


def kernel_available() -> bool:
    lib = kernels.library()
    return lib is not None and bool(lib.quant_linear_available())


# ---- the kernel's layouts (see csrc/quant_gemm.c) -------------------------------------------
def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> [N/8, K/4, 8, 4]."""
    n, k = q.shape
    return q.reshape(n // 8, 8, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] in 0..15, or int8 in -8..7 (held as q + Q4_OFFSET) -> [N/8, K/32, 4, 32]:
    vector p holds k-group p (low nibbles) and k-group p + 4 (high nibbles), each as 8 columns × 4 k."""
    if q.dtype == torch.int8:
        q = (q + Q4_OFFSET).to(torch.uint8)
    n, k = q.shape
    groups = q.reshape(n // 8, 8, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [N/8, KB, group, col, k]
    return (groups[:, :, :4] | (groups[:, :, 4:] << 4)).reshape(n // 8, k // BLOCK, 4, 32).contiguous()


def pack_q5(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in -16..15 -> uint8 [N/8, K/32, 160]: u = q + 16's low four bits as pack_q4
    (128 bytes), then a 32-byte plane of fifth bits: bit j of byte i is the fifth bit of k-group j's
    value at byte i of its vector (column i / 4, k i % 4), so one shift and one AND give a vector's."""
    n, k = q.shape
    u = (q.to(torch.int16) + 16).to(torch.uint8)
    fifth = (u >> 4).reshape(n // 8, 8, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [N/8, KB, group, col, k]
    plane = (fifth << torch.arange(8, dtype=torch.uint8)[:, None, None]).sum(2, dtype=torch.uint8)
    nibbles = pack_q4(u & 0x0F).reshape(n // 8, k // BLOCK, 128)
    return torch.cat((nibbles, plane.reshape(n // 8, k // BLOCK, 32)), dim=-1).contiguous()


def pack_q6(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in -32..31 -> uint8 [N/8, K/32, 192]: u = q + Q6_OFFSET's low four bits as pack_q4
    (128 bytes), then two 32-byte planes of its high two bits: bits 2j, 2j + 1 of byte i of the
    first are k-group j's value at byte i of its vector (j < 4), of the second k-group 4 + j's."""
    n, k = q.shape
    u = (q.to(torch.int16) + Q6_OFFSET).to(torch.uint8)
    high = (u >> 4).reshape(n // 8, 8, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [N/8, KB, group, col, k]
    shifts = 2 * torch.arange(4, dtype=torch.uint8)[:, None, None]
    planes = [(high[:, :, 4 * h : 4 * h + 4] << shifts).sum(2, dtype=torch.uint8).reshape(n // 8, k // BLOCK, 32)
              for h in (0, 1)]
    nibbles = pack_q4(u & 0x0F).reshape(n // 8, k // BLOCK, 128)
    return torch.cat((nibbles, *planes), dim=-1).contiguous()


def pack_block_values(values: torch.Tensor) -> torch.Tensor:
    """scale/min [N, K/32] (or [N, K/16]) -> [N/8, K/32, 8] (or [N/8, K/16, 8])."""
    n, kb = values.shape
    return values.reshape(n // 8, 8, kb).permute(0, 2, 1).contiguous()


def pack_super_block_values(values: SuperBlockValues) -> torch.Tensor:
    """-> uint8 [N/8, K/256, 80 or 144]: per group and super-block, the 8 columns' fp16 factors,
    then the 8 blocks' (or 16 half blocks') multiples, 8 columns each (csrc/team.h's
    SUPER_BLOCK_BYTES)."""
    n, supers = values.factor.shape
    factors = pack_block_values(values.factor.to(torch.float16)).view(torch.uint8)  # [N/8, S, 16]
    multiples = pack_block_values(values.multiple).view(torch.uint8).reshape(n // 8, supers, -1)
    return torch.cat((factors, multiples), dim=-1).contiguous()


class ScaleFormat(enum.IntEnum):
    """How the kernel reads a layer's block scales and minimums: csrc/team.h's SCALES_*."""

    F32 = 0
    F16 = 1
    SUPER_BLOCKS = 2  # SuperBlockValues, packed by pack_super_block_values


class QuantizedLinear(nn.Module):
    """y = x · Wᵀ + bias with W in its packed quantised form; also the embedding table when the
    weight is one (`rows`)."""

    weight: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, quantized: Quantized, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bits = quantized.bits
        self.out_features, self.in_features = quantized.shape
        if not fits_kernel(self.out_features, self.in_features):
            raise ValueError(f"quantised linear {quantized.shape}: out_features must be a multiple of 8, "
                             f"in_features of {BLOCK}")
        self.register_buffer("weight", _PACKERS[self.bits](quantized.q))
        self.scale_format = _scale_format(quantized)
        if self.scale_format == ScaleFormat.SUPER_BLOCKS:
            assert quantized.factors is not None
            scale, low = (None if f is None else pack_super_block_values(f) for f in quantized.factors)
        else:
            dtype = torch.float16 if self.scale_format == ScaleFormat.F16 else torch.float32
            scale = pack_block_values(quantized.scale.to(dtype))
            low = None if quantized.min is None else pack_block_values(quantized.min.to(dtype))
        self.register_buffer("scale", scale)
        self.register_buffer("min", low)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._apply(lambda t: t)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)  # .to() and friends may replace the buffers
        tensors = (self.weight, self.scale, self.min, self.bias)
        self._pointers = tuple(None if t is None else t.data_ptr() for t in tensors)
        self._kernel_args = self.kernel_args()
        return self

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: a contiguous fp32 [rows, out_features] tensor to write y to (one kept across
        calls, where a fresh one would be paged in every time)."""
        # A decode step makes ~120 of these calls: the pointers are read once (see _apply), not
        # through nn.Module attribute lookups each time.
        return _run_kernel(self._kernel_args, self.out_features, x, out)

    def kernel_args(self) -> kernels.QuantLinear:
        """This layer as csrc/team.h's QuantLinear (for kernels that call the matmul themselves)."""
        return kernels.QuantLinear(self.bits, self.out_features, self.in_features, self.scale_format,
                                   *self._pointers)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` of W (an embedding lookup), unpacked from the kernel layout by
        csrc/quant_gemm.c's quant_rows."""
        lib = kernels.library()
        assert lib is not None, "the CPU kernels did not build"
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(len(ids), self.in_features)
        if lib.quant_rows(ctypes.byref(self._kernel_args), ids.data_ptr(), len(ids), out.data_ptr()) != 0:
            bad = ids[(ids < 0) | (ids >= self.out_features)].tolist()
            raise IndexError(f"token ids out of range 0..{self.out_features - 1}: {bad[:10]}")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class StackedQuantizedLinear(nn.Module):
    """A fused projection whose parts keep formats of their own (QuantizedParts), run as one layer:
    x quantised once, then each part's columns (csrc/team.h's `next`)."""

    def __init__(self, stacked: QuantizedParts, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = stacked.shape
        ends = torch.tensor([p.shape[0] for p in stacked.parts]).cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        self.parts = nn.ModuleList(QuantizedLinear(p, None if bias is None else bias[a:b])
                                   for p, a, b in zip(stacked.parts, starts, ends, strict=True))
        self._apply(lambda t: t)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)  # the parts' buffers may move: their pointers are read again
        chain = [part.kernel_args() for part in self.parts]
        for part, following in itertools.pairwise(chain):
            part.next = ctypes.addressof(following)
        self._chain = chain  # each part's `next` points into this list: kept with the module
        return self

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _run_kernel(self._chain[0], self.out_features, x, out)

    def kernel_args(self) -> kernels.QuantLinear:
        """The first part as csrc/team.h's QuantLinear, the others chained to it (valid while this
        module lives)."""
        return self._chain[0]


def _run_kernel(layer: kernels.QuantLinear, n: int, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """y = x · Wᵀ + bias by csrc/quant_gemm.c (n: every part's out_features), into `out` where given."""
    lib = kernels.library()
    assert lib is not None, "the CPU kernels did not build"
    lead, k = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, k)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    y = torch.empty(x.shape[0], n) if out is None else out
    assert y.shape == (x.shape[0], n) and y.dtype == torch.float32 and y.is_contiguous()
    status = lib.quant_linear(ctypes.byref(layer), x.data_ptr(), y.data_ptr(), x.shape[0], torch.get_num_threads())
    if status != 0:
        widths = "+".join(f"{part.out_features} ({part.bits} bits)" for part in _chained(layer))
        raise RuntimeError(f"quant_linear failed ({status}) for {widths} x {k}")
    return y.view(*lead, n)


def _chained(layer: kernels.QuantLinear) -> list[kernels.QuantLinear]:
    parts = [layer]
    while parts[-1].next:
        parts.append(kernels.QuantLinear.from_address(parts[-1].next))
    return parts


_PACKERS = {4: pack_q4, 5: pack_q5, 6: pack_q6, 8: pack_q8}


def _scale_format(quantized: Quantized) -> ScaleFormat:
    """Q4_K's or Q6_K's own factors where there are some (Q4_K: 4.625 bits a weight, where fp16
    values take 5 and fp32 ones 6, the file's 4.5 packing the 6-bit multiples tighter; Q6_K: its
    6.5625); else fp16 where every scale and minimum survives the trip (a GGUF's Q4_0, Q4_1 and
    Q8_0 blocks: the file holds them in fp16), a step then reading 20 bytes per 4-bit block, not
    24; else fp32."""
    if quantized.factors is not None and quantized.bits in (4, 6) and quantized.shape[1] % SUPER_BLOCK == 0:
        return ScaleFormat.SUPER_BLOCKS
    values = [t for t in (quantized.scale, quantized.min) if t is not None]
    if all(torch.equal(t.half().float(), t) for t in values):
        return ScaleFormat.F16
    return ScaleFormat.F32


class QuantizedEmbedding(nn.Module):
    """An embedding lookup reading the rows of a QuantizedLinear (the tied lm_head's, or its own)."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.reshape(-1)).reshape(*ids.shape, self.table.in_features)


def install_quantized(model: nn.Module, quantized: dict[str, Quantized | QuantizedParts]) -> None:
    """Replace the nn.Linear / nn.Embedding owning each `NAME.weight` by its quantised form (a
    linear keeps its bias; a fused one of parts in several formats is a StackedQuantizedLinear)."""
    for name, weight in quantized.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent, module = model.get_submodule(parent_path), model.get_submodule(path)
        if isinstance(module, nn.Embedding):
            assert isinstance(weight, Quantized), f"{name}: an embedding table of several parts"
            setattr(parent, attr, QuantizedEmbedding(QuantizedLinear(weight)))
        else:
            assert isinstance(module, nn.Linear), f"{name}: not a linear layer"
            bias = None if module.bias is None or module.bias.is_meta else module.bias
            if isinstance(weight, QuantizedParts):
                setattr(parent, attr, StackedQuantizedLinear(weight, bias))
            else:
                setattr(parent, attr, QuantizedLinear(weight, bias))


# ---- from GGUF blocks ---------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def from_gguf_blocks(raw: np.ndarray, ggml_type: str, n: int, k: int) -> Quantized | None:
    """Q8_0, Q6_K, Q5_0, Q4_0, Q4_1 and Q4_K row bytes [N, row_bytes] as a Quantized without
    fp32; None for other types. Layouts as in ggml-common.h."""
    rows = np.ascontiguousarray(raw).reshape(n, -1)
    if ggml_type == "Q8_0":  # 2-byte fp16 d, 32 int8
        b = rows.reshape(n, k // 32, 34)
        return Quantized(8, _t(b[..., 2:].view(np.int8).reshape(n, k)), _t(_f16(b[..., :2])[..., 0]))
    if ggml_type == "Q5_0":  # fp16 d, 4 bytes of fifth bits, 16 of nibbles: d · (q - 16), q in 0..31
        b = rows.reshape(n, k // 32, 22)
        high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # bit j of the uint32: element j's
        q = _nibbles(b[..., 6:], n, k).reshape(n, k // 32, 32) | (high << 4)
        return Quantized(5, _t((q.astype(np.int16) - 16).astype(np.int8).reshape(n, k)), _t(_f16(b[..., :2])[..., 0]))
    if ggml_type == "Q4_0":  # fp16 d, then 16 bytes (element j low nibble, j+16 high): d · (q - 8)
        b = rows.reshape(n, k // 32, 18)
        q = _nibbles(b[..., 2:], n, k).astype(np.int8) - Q4_OFFSET
        return Quantized(4, _t(q), _t(_f16(b[..., :2])[..., 0]))
    if ggml_type == "Q4_1":  # fp16 d and m, then 16 bytes as Q4_0's: d · q + m
        b = rows.reshape(n, k // 32, 20)
        return Quantized(4, _t(_nibbles(b[..., 4:], n, k)), _t(_f16(b[..., :2])[..., 0]), _t(_f16(b[..., 2:4])[..., 0]))
    if ggml_type == "Q4_K":
        return _from_q4_k(rows, n, k)
    if ggml_type == "Q6_K":
        return _from_q6_k(rows, n, k)
    return None


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _nibbles(qs: np.ndarray, n: int, k: int) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(n, k)


def _from_q4_k(rows: np.ndarray, n: int, k: int) -> Quantized:
    """Super-blocks of 256: fp16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
    of nibbles (each 32 bytes hold sub-block 2i in low nibbles, 2i+1 in high). Sub-block j's value
    is d·sc_j·q − dmin·m_j: a q4 block with scale d·sc_j and min −dmin·m_j, exactly."""
    b = rows.reshape(n, k // 256, 144)
    d, dmin = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    packed = b[..., 4:16].astype(np.uint8)
    sc, mn = np.empty(packed.shape[:-1] + (8,), np.uint8), np.empty(packed.shape[:-1] + (8,), np.uint8)
    sc[..., :4], mn[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)
    q = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(n, k)  # [N, SB, 4 pairs, lo/hi, 32]
    factors = (SuperBlockValues(_t(d).half(), _t(sc.reshape(n, k // 32))),
               SuperBlockValues(_t(-dmin).half(), _t(mn.reshape(n, k // 32))))
    return Quantized(4, _t(q), factors[0].values(), factors[1].values(), factors)


def _from_q6_k(rows: np.ndarray, n: int, k: int) -> Quantized:
    """Super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one a
    half block of 16), fp16 d. Each 128 values take 64 bytes of the first and 32 of the second:
    value l (< 32) + 32·i, i = 0..3, has nibble i // 2 (low, high) of byte l + 32·(i % 2) and bit
    pair i of byte l; its value is d·scale·(q − 32)."""
    b = rows.reshape(n, k // 256, 210)
    low = b[..., :128].reshape(n, k // 256, 2, 1, 2, 32)  # [N, SB, 128s, -, byte half, l]
    nibbles = np.concatenate((low & 0x0F, low >> 4), axis=3)  # [N, SB, 128s, nibble, byte half, l]
    high = b[..., 128:192].reshape(n, k // 256, 2, 1, 32)
    # bit pair i = 2·nibble + byte half
    pairs = ((high >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(nibbles.shape)
    q = (nibbles | (pairs << 4)).astype(np.int16) - Q6_OFFSET
    multiples = b[..., 192:208].view(np.int8).reshape(n, k // HALF_BLOCK)
    factors = SuperBlockValues(_t(_f16(b[..., 208:210])[..., 0]).half(), _t(multiples))
    return Quantized(6, _t(q.astype(np.int8).reshape(n, k)), factors.values(), None, (factors, None))
