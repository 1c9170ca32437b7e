"""The header of a GGUF file (llama.cpp's format): metadata, tensor infos and where the data starts,
and the tensors' bytes located from it.

Parsed here rather than by `gguf.GGUFReader`, which builds a numpy view of every element of every
metadata array (15-19 s for Gemma 3's 262k-token vocabulary on 2 cores, 9 s of SmolLM2's 12 s
load). Arrays longer than MAX_KEPT_ARRAY are the vocabulary (tokens, scores, merges): they are
stepped over without being decoded, since only the tokenizer needs them and transformers builds it
from the file separately. Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.

numpy and `gguf` only, no torch: the model loader, `tokenmill info` and the planner all read
headers with it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

MAX_KEPT_ARRAY = 4096  # longer metadata arrays are skipped; small ones (per-layer values) are kept
DEFAULT_ALIGNMENT = 32  # of the data section, unless general.alignment says otherwise
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # little-endian; v1 had 32-bit counts
# Metadata value types: scalar id -> struct format; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # innermost dimension first, as GGUF stores it
    ggml_type: int  # a gguf.GGMLQuantizationType value
    n_elements: int
    n_bytes: int  # stored size: quantised blocks with their scales
    data_offset: int  # absolute position of its first byte in the file

    @property
    def type_name(self) -> str:
        """Its gguf.GGMLQuantizationType name ("Q4_K", "F32", ...); the reader has checked it is one."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    @property
    def row_bytes(self) -> int:
        """Bytes of one innermost row (a whole number of quantisation blocks)."""
        return self.n_bytes // (self.n_elements // self.shape[0]) if self.n_elements else 0


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # arrays longer than MAX_KEPT_ARRAY left out (see skipped_arrays)
    skipped_arrays: dict[str, int]  # key -> length of each array left out
    tensors: dict[str, TensorInfo]  # in file order
    data_start: int  # absolute offset of the (aligned) tensor data section


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse a little-endian GGUF v2/v3 header; no tensor data is read. ValueError (naming the
    file) for a file that is not GGUF, a version not read here, or a truncated file."""
    with open(path, "rb") as file:
        if file.read(len(_MAGIC)) != _MAGIC:  # also before mmap, which refuses an empty file
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(_Cursor(buf), Path(path))
            except struct.error:
                raise ValueError(f"{path}: GGUF header ends early (truncated file?)") from None
            except ValueError as exc:
                raise ValueError(f"{path}: {exc}") from None


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, len(_MAGIC)

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        if self.pos + size > len(self.buf):
            raise struct.error("string past the end")
        self.pos += size
        return self.buf[self.pos - size : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.scalar("<I"), self.scalar("<Q")
        return [self.value(item_kind) for _ in range(count)]

    def skip_array(self) -> int:
        """Step over an array without decoding it; its length."""
        item_kind, count = self.scalar("<I"), self.scalar("<Q")
        if item_kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item_kind]) * count
        elif item_kind == _STRING:
            for _ in range(count):  # each string carries its own length
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        elif item_kind == _ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            raise ValueError(f"unknown GGUF value type {item_kind}")
        if self.pos > len(self.buf):
            raise struct.error("array past the end")
        return count

    def array_length(self) -> int:
        """The length of the array starting here, without moving."""
        return struct.unpack_from("<Q", self.buf, self.pos + 4)[0]


def _parse(cursor: _Cursor, path: Path) -> GGUFHeader:
    version = cursor.scalar("<I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (big-endian or too old?)")
    n_tensors, n_values = cursor.scalar("<Q"), cursor.scalar("<Q")
    metadata: dict[str, Any] = {}
    skipped: dict[str, int] = {}
    for _ in range(n_values):
        key, kind = cursor.string(), cursor.scalar("<I")
        if kind == _ARRAY and cursor.array_length() > MAX_KEPT_ARRAY:
            skipped[key] = cursor.skip_array()
        else:
            metadata[key] = cursor.value(kind)
    raw = [_raw_tensor_info(cursor) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment < 1:
        raise ValueError(f"general.alignment {alignment} is not a positive number of bytes")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in raw:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        tensors[name] = _tensor_info(name, shape, ggml_type, data_start + offset, len(cursor.buf))
    return GGUFHeader(path, version, metadata, skipped, tensors, data_start)


def _raw_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    shape = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
    return name, shape, cursor.scalar("<I"), cursor.scalar("<Q")


def _tensor_info(name: str, shape: tuple[int, ...], ggml_type: int, start: int, file_size: int) -> TensorInfo:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # imported here: only header readers pay for it

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise ValueError(f"tensor {name!r} has unknown GGML type {ggml_type}") from None
    if shape and shape[0] % block:
        raise ValueError(f"tensor {name!r}: rows of {shape[0]} do not split into blocks of {block}")
    n_elements = 1
    for dim in shape:
        n_elements *= dim
    n_bytes = n_elements // block * block_bytes
    if start + n_bytes > file_size:
        raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
    return TensorInfo(name, shape, ggml_type, n_elements, n_bytes, start)


def file_bytes(header: GGUFHeader) -> np.ndarray:
    """The whole file, memory-mapped: tensors are views of it until they are dequantised."""
    import numpy as np  # here, not above: a planner reading only presets never loads numpy

    return np.memmap(header.path, dtype=np.uint8, mode="r")


def tensor_bytes(info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """Its bytes, one row per innermost row (what gguf.quants.dequantize takes); not yet copied."""
    raw = data[info.data_offset : info.data_offset + info.n_bytes]
    return raw.reshape(*reversed(info.shape[1:]), info.row_bytes)


def dequantize(info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """fp32 values, outermost dimension first (the HF layout), as transformers' loader gets them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as dequantize_blocks

    return dequantize_blocks(tensor_bytes(info, data), GGMLQuantizationType(info.ggml_type))
