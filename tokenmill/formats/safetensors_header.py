"""The JSON header of a safetensors file: each tensor's dtype, shape and byte range, no data read."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """Each tensor's entry (dtype, shape, data_offsets) from the file's JSON header (an 8-byte
    length, then the JSON): no tensor data is read."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        tensors = {name: info for name, info in header.items() if name != "__metadata__"}
        if not all(isinstance(info, dict) and "dtype" in info for info in tensors.values()):
            raise ValueError("a tensor entry has no dtype")
        return tensors
    except (struct.error, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{file}: not a safetensors file ({exc!r})") from exc
