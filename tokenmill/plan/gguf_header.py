"""A minimal GGUF header reader: metadata scalars and tensor shapes/types, nothing else.

``gguf.GGUFReader`` builds numpy views of every array in the file, which takes ~5 s for the
SmolLM2 file's 49k-token vocabulary on this machine; the planner only needs a few integers, so
it parses the header itself (layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
and skips arrays. Quantised block sizes come from the ``gguf`` package.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PlanError

# GGUF value type id -> struct format of one scalar element
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEPT_ARRAY = 4096  # small numeric arrays (per-layer head counts) are kept, the rest skipped


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise ValueError(f"unknown GGUF value type {vtype}")

    def array(self) -> list[Any] | None:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in _SCALARS:
            size = struct.calcsize(_SCALARS[etype])
            if count > _MAX_KEPT_ARRAY:  # e.g. token types: skip without decoding
                self.pos += size * count
                return None
        elif count > _MAX_KEPT_ARRAY and etype == _STRING:
            for _ in range(count):  # strings have their own lengths: walk them, keep nothing
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            return None
        return [self.value(etype) for _ in range(count)]


def _tensor_bytes(ggml_type: int, n_elements: int, name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise PlanError("model", f"tensor {name!r} has unknown GGML type {ggml_type}") from None
    return n_elements // block * type_size


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse metadata and tensor infos of a GGUF v2/v3 file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf), path)
    except (OSError, ValueError, struct.error) as exc:
        raise PlanError("model", f"cannot read GGUF {path}: {exc}") from None


def _parse(cur: _Cursor, path: Path) -> GGUFHeader:
    if bytes(cur.buf[:4]) != b"GGUF":
        raise PlanError("model", f"{path} is not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version < 2:
        raise PlanError("model", f"{path}: GGUF version {version} is not supported")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
        ggml_type = cur.unpack("<I")
        cur.unpack("<Q")  # data offset: not needed
        n = 1
        for dim in shape:
            n *= dim
        tensors.append(TensorInfo(name, shape, ggml_type, n, _tensor_bytes(ggml_type, n, name)))
    return GGUFHeader(metadata, tuple(tensors))
