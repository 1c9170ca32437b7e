"""Weights kept quantised in memory: blocks of 32 along the input dimension, run by
csrc/quant_gemm.c.

Three formats, each with a scale per block (and, for 4 bits, a minimum where the source has one):
- q8: value = scale · q, q in [-127, 127] (llama.cpp's Q8_0);
- q5: value = scale · q, q in [-16, 15] (llama.cpp's Q5_0; fits q8 exactly, so mixed with 8-bit
  parts in a fused projection it simply becomes 8 bits);
- q4: value = scale · q + min, q in [0, 15] (Q4_1 and Q4_K's sub-blocks fit exactly), or without
  minimums value = scale · q, q in [-8, 7] (Q4_0: its min would always be -8 · scale; it fits q8
  exactly as q5 does).
A GGUF's blocks of those types become these without a round trip through fp32; anything else
(fp32/bf16 weights, other GGUF types) is quantised from fp32 at load (`quantize`, 4 or 8 bits).
The kernel reads the block values in fp16 where that holds them exactly (Q4_0, Q4_1, Q8_0), as
Q4_K's own factors where they came from one (`SuperBlockValues`), else in fp32.

`Quantized` is the unpacked form the loader hands over (one value per byte, rows in the
Hugging Face order, so q/k rows can be permuted and q/k/v concatenated like fp32 weights).
`QuantizedLinear` packs it once into the kernel's layout.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.models import kernels
from tokenmill.models.weight_formats import WEIGHT_FORMATS as WEIGHT_FORMATS  # its old home

BLOCK = 32
Q4_OFFSET = 8  # 4 bits without minimums are stored as q + 8: csrc/team.h's Q4_OFFSET
SUPER_BLOCK = 256  # a k-quant's: csrc/team.h's SUPER_BLOCK
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
_FIVE_BIT = ("Q5_0",)
_EIGHT_BIT = ("Q8_0",)
# The GGUF types from_gguf_blocks maps exactly, by the bits it keeps them in.
_EXACT = {4: _FOUR_BIT, 5: _FIVE_BIT, 8: _EIGHT_BIT}
# Those whose blocks are scale · q, no minimums: they widen to 8-bit blocks exactly.
_WIDEN_EXACTLY = ("Q4_0", "Q5_0")
_FLOAT = ("F32", "F16", "BF16", "F64")
# Weights read by a token id, or producing the logits: kept at 8 bits under q4 (as llama.cpp's
# 4-bit presets keep the output layer wider) unless the file already has them in 4 bits.
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass
class SuperBlockValues:
    """Block values (scales or minimums) as a k-quant holds them: an fp16 factor per super-block
    of 256 times a small integer per block (Q4_K's 6-bit ones), each product exact in fp32 and
    not, in general, in fp16."""

    factor: torch.Tensor  # fp16 [N, K / 256]
    multiple: torch.Tensor  # uint8 [N, K / 32]

    def values(self) -> torch.Tensor:
        """fp32 [N, K / 32]."""
        per_block = self.factor.float().repeat_interleave(SUPER_BLOCK // BLOCK, dim=-1)
        return per_block * self.multiple.float()

    def permute_rows(self, order: torch.Tensor) -> SuperBlockValues:
        return SuperBlockValues(self.factor[order], self.multiple[order])

    @staticmethod
    def cat(parts: list[SuperBlockValues]) -> SuperBlockValues:
        return SuperBlockValues(torch.cat([p.factor for p in parts]), torch.cat([p.multiple for p in parts]))


@dataclass
class Quantized:
    """A [N, K] weight: q [N, K], uint8 for 4 bits with minimums, else int8 (value = scale · q);
    scale (and min, 4 bits only) fp32 [N, K / 32]; for 4 bits from Q4_K, `factors` are the same
    scale and min as that file's super-block factors (SuperBlockValues), which the kernel reads
    instead."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None
    factors: tuple[SuperBlockValues, SuperBlockValues] | None = None  # scale, min

    @property
    def shape(self) -> tuple[int, int]:  # (out_features N, in_features K)
        return (self.q.shape[0], self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        n, k = self.shape
        blocks = self.q.reshape(n, k // BLOCK, BLOCK).float() * self.scale[..., None]
        if self.min is not None:
            blocks = blocks + self.min[..., None]
        return blocks.reshape(n, k)

    def permute_rows(self, order: torch.Tensor) -> Quantized:
        factors = None if self.factors is None else (self.factors[0].permute_rows(order),
                                                     self.factors[1].permute_rows(order))
        return Quantized(self.bits, self.q[order], self.scale[order], None if self.min is None else self.min[order],
                         factors)

    def exactly_as(self, bits: int) -> Quantized | None:
        """The same values in `bits`-bit blocks where no rounding is needed (blocks without
        minimums widen to 8 as they are), else None."""
        if bits == self.bits:
            return self
        return Quantized(8, self.q, self.scale) if bits == 8 and self.min is None else None

    def with_minimums(self) -> Quantized:
        """4 bits: the same values as scale · u + min, u in [0, 15] (exact for scales of at most 20
        significant bits, as Q4_0's fp16 ones)."""
        if self.min is not None:
            return self
        return Quantized(4, (self.q + Q4_OFFSET).to(torch.uint8), self.scale, -Q4_OFFSET * self.scale)


Weight = torch.Tensor | Quantized  # a state dict's value once the loader may keep blocks


def target_bits(setting: str, name: str, source_type: str, ndim: int = 2) -> int | None:
    """The bits a weight is kept in under `setting` (None: fp32). `source_type`: its GGUF type name
    ("Q4_K", "F16", ...), "F32" for safetensors weights. auto keeps a quantised file quantised:
    4-bit types in 4 bits, Q5_0 in 5 and Q8_0 in 8 (all exactly), other types (Q5_1, Q6_K...) in 8
    (requantised)."""
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


def concatenate(parts: list[Quantized]) -> Quantized:
    """Stacked along N (fused q/k/v or gate/up). Mixed widths meet at 8 bits: a part without
    minimums as it is, a 4-bit one with them requantised (its values fit 8 bits up to the rounding
    of an asymmetric grid); 4-bit parts with and without minimums meet with them."""
    if len({p.bits for p in parts}) > 1:
        parts = [p.exactly_as(8) or quantize(p.dequantize(), 8) for p in parts]
    elif len({p.min is None for p in parts}) > 1:
        parts = [p.with_minimums() for p in parts]
    mins = [p.min for p in parts]
    factors = [p.factors for p in parts if p.factors is not None]
    return Quantized(
        parts[0].bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
        None if mins[0] is None else torch.cat([m for m in mins if m is not None]),
        (SuperBlockValues.cat([f[0] for f in factors]), SuperBlockValues.cat([f[1] for f in factors]))
        if len(factors) == len(parts) else None,
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


def pack_block_values(values: torch.Tensor) -> torch.Tensor:
    """scale/min [N, K/32] -> [N/8, K/32, 8]."""
    n, kb = values.shape
    return values.reshape(n // 8, 8, kb).permute(0, 2, 1).contiguous()


def pack_super_block_values(values: SuperBlockValues) -> torch.Tensor:
    """-> uint8 [N/8, K/256, 80]: per group and super-block, the 8 columns' fp16 factors, then the
    8 blocks' multiples, 8 columns each (csrc/team.h's SUPER_BLOCK_BYTES)."""
    n, supers = values.factor.shape
    factors = pack_block_values(values.factor.to(torch.float16)).view(torch.uint8)  # [N/8, S, 16]
    per_block = SUPER_BLOCK // BLOCK
    multiples = pack_block_values(values.multiple).reshape(n // 8, supers, per_block * 8)
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
            scale, low = (pack_super_block_values(f) for f in quantized.factors)
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
        lib = kernels.library()
        assert lib is not None, "the CPU kernels did not build"
        lead, k = x.shape[:-1], x.shape[-1]
        x = x.reshape(-1, k)
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.out_features) if out is None else out
        assert y.shape == (x.shape[0], self.out_features) and y.dtype == torch.float32 and y.is_contiguous()
        status = lib.quant_linear(self.bits, self.scale_format, x.data_ptr(), *self._pointers, y.data_ptr(),
                                  x.shape[0], self.out_features, k, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"quant_linear failed ({status}) for {self.out_features}x{k}, {self.bits} bits")
        return y.view(*lead, self.out_features)

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


_PACKERS = {4: pack_q4, 5: pack_q5, 8: pack_q8}


def _scale_format(quantized: Quantized) -> ScaleFormat:
    """Q4_K's own factors where there are some (4.625 bits a weight, where fp16 values take 5 and
    fp32 ones 6; the file's 4.5 packs the 6-bit multiples tighter); else fp16 where every scale and
    minimum survives the trip (a GGUF's Q4_0, Q4_1 and Q8_0 blocks: the file holds them in fp16),
    a step then reading 20 bytes per 4-bit block, not 24; else fp32."""
    if quantized.factors is not None and quantized.bits == 4 and quantized.shape[1] % SUPER_BLOCK == 0:
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


def install_quantized(model: nn.Module, quantized: dict[str, Quantized]) -> None:
    """Replace the nn.Linear / nn.Embedding owning each `NAME.weight` by its quantised form (a
    linear keeps its bias)."""
    for name, weight in quantized.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent, module = model.get_submodule(parent_path), model.get_submodule(path)
        if isinstance(module, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(QuantizedLinear(weight)))
        else:
            assert isinstance(module, nn.Linear), f"{name}: not a linear layer"
            bias = None if module.bias is None or module.bias.is_meta else module.bias
            setattr(parent, attr, QuantizedLinear(weight, bias))


# ---- from GGUF blocks ---------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def from_gguf_blocks(raw: np.ndarray, ggml_type: str, n: int, k: int) -> Quantized | None:
    """Q8_0, Q5_0, Q4_0, Q4_1 and Q4_K row bytes [N, row_bytes] as a Quantized without
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
