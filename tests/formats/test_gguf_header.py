"""The one GGUF header reader, on tiny files written by the `gguf` package and checked against its
own reader: metadata kept and vocabulary-sized arrays skipped, tensor shapes, types, sizes and
offsets, and clear errors for what is not a readable GGUF file."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenmill.formats.gguf_header import DEFAULT_ALIGNMENT, MAX_KEPT_ARRAY, read_gguf_header

LONG = MAX_KEPT_ARRAY + 1


def _write(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name("tiny")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_array("llama.attention.head_count_kv", [1, 2, 3])  # small: kept
    writer.add_token_list([f"token{i}" for i in range(LONG)])  # long: skipped
    writer.add_array("test.long_ints", list(range(LONG)))
    writer.add_tensor("f32.weight", rng.standard_normal((3, 8)).astype(np.float32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_matches_gguf_reader(tmp_path: Path, alignment: int | None) -> None:
    path = _write(tmp_path / "tiny.gguf", alignment)
    header = read_gguf_header(path)
    reference = gguf.GGUFReader(path)

    assert header.path == path and header.version == 3
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["general.name"] == "tiny"
    assert header.metadata["llama.block_count"] == 2
    assert header.metadata["llama.rope.freq_base"] == 10000.0
    assert header.metadata["llama.attention.head_count_kv"] == [1, 2, 3]
    assert header.skipped_arrays == {"tokenizer.ggml.tokens": LONG, "test.long_ints": LONG}
    assert not set(header.skipped_arrays) & set(header.metadata)

    assert header.data_start == reference.data_offset
    assert header.data_start % (alignment or DEFAULT_ALIGNMENT) == 0
    f32, q8 = header.tensors.values()
    assert (f32.name, f32.shape, f32.ggml_type, f32.n_elements, f32.n_bytes) == (
        "f32.weight", (8, 3), gguf.GGMLQuantizationType.F32, 24, 24 * 4)
    # Q8_0: blocks of 32 weights in 34 bytes (an fp16 scale and 32 int8).
    assert (q8.name, q8.shape, q8.ggml_type, q8.n_elements, q8.n_bytes) == (
        "q8.weight", (64, 4), gguf.GGMLQuantizationType.Q8_0, 256, 256 // 32 * 34)
    assert q8.row_bytes == 64 // 32 * 34
    data = path.read_bytes()
    for info, ref in zip(header.tensors.values(), reference.tensors, strict=True):
        assert (info.name, list(info.shape), info.ggml_type) == (ref.name, ref.shape.tolist(), ref.tensor_type)
        assert (info.n_elements, info.n_bytes, info.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert data[info.data_offset : info.data_offset + info.n_bytes] == ref.data.tobytes()


def test_not_a_gguf_file_is_named(tmp_path: Path) -> None:
    for name, content in (("empty.gguf", b""), ("nope.gguf", b"NOPE" + bytes(64))):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path / name))} is not a GGUF file"):
            read_gguf_header(tmp_path / name)


def test_an_unsupported_version_is_named(tmp_path: Path) -> None:
    path = tmp_path / "v1.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(64))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: GGUF version 1 is not supported"):
        read_gguf_header(path)


@pytest.mark.parametrize(("cut", "error"), [("header", "header ends early"), ("data", "runs past the end of the file")])
def test_a_truncated_file_is_named(tmp_path: Path, cut: str, error: str) -> None:
    """Cut inside the header (in the long token list) or inside the last tensor's data."""
    path = _write(tmp_path / "cut.gguf")
    last = list(read_gguf_header(path).tensors.values())[-1]
    keep = 1000 if cut == "header" else last.data_offset + last.n_bytes - 1
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*{error}"):
        read_gguf_header(path)
