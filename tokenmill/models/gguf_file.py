"""Read a GGUF file (llama.cpp's format) into a Hugging Face style config and state dict.

Quantised tensors (K-quants included) are dequantised with the `gguf` package. What llama.cpp's
converter changed on the way in is undone, so the tensors equal what transformers' own GGUF
loader gives:
- llama-architecture q/k projections are stored permuted for llama.cpp's interleaved RoPE; they
  are permuted back so the usual half-split RoPE applies (no other architecture is permuted).
- Gemma norm weights are stored with 1 added (llama.cpp scales by w, Gemma's RMSNorm by 1 + w).
- Llama 3.1+ RoPE scaling is stored as a `rope_freqs` tensor of per-frequency divisors, not as
  metadata; it goes into the config as `rope_freq_factors`, not into the state dict.

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy view of every
element of every metadata array (15-19 s for Gemma 3's 262k-token vocabulary on 2 cores, 9 s of
SmolLM2's 12 s load). This reader skips those arrays: only the tokenizer needs them, and
transformers builds it from the file separately.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma3")
# A GGUF architecture whose transformers model_type has another name.
_MODEL_TYPES = {"gemma3": "gemma3_text"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 normalises around both sublayers: llama.cpp's `ffn_norm` is its pre-feedforward norm,
# and `post_attention_norm` the norm of the attention output (transformers'
# post_attention_layernorm), so the llama meaning of `ffn_norm` does not carry over.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Qwen3: llama's layer plus RMSNorms on each head's queries and keys.
_QWEN3_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ROPE_FREQS = "rope_freqs.weight"
# What llama.cpp fixes for Gemma 3 rather than writing to the file (llama-model.cpp).
_GEMMA3_SLIDING_PERIOD = 6  # every 6th layer attends globally, the others to a sliding window
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is not 1/sqrt(head_dim)


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF-style config dict, HF-named fp32 state dict) of a GGUF file."""
    parsed = _read(path)
    arch = parsed.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    config = _gguf_config(parsed, arch)
    state_dict = {}
    for name, tensor in parsed.tensors.items():
        if name == ROPE_FREQS:
            continue  # in the config as rope_freq_factors
        hf_name = _hf_name(name, arch)
        state_dict[hf_name] = _hf_tensor(tensor, hf_name, arch, config)
    return config, state_dict


# GGUF metadata value types (ggml's docs/gguf.md): scalar id -> struct format; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEPT_ARRAY = 4096  # longer arrays are the vocabulary (tokens, scores, merges): skipped
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # innermost dimension first, as GGUF stores it
    ggml_type: int
    data: np.ndarray  # its bytes, one row per innermost row (what gguf.quants.dequantize takes)


@dataclass(frozen=True)
class _GGUF:
    metadata: dict[str, Any]  # arrays longer than _MAX_KEPT_ARRAY left out
    tensors: dict[str, _Tensor]  # in file order


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
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
        if count <= _MAX_KEPT_ARRAY:
            return [self.value(item_kind) for _ in range(count)]
        self.skip(item_kind, count)
        return None

    def skip(self, kind: int, count: int) -> None:
        if kind in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[kind]) * count
        elif kind == _STRING:
            for _ in range(count):  # each string carries its own length
                self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
        else:
            raise ValueError(f"GGUF array of type {kind} is not supported")


def _read(path: Path) -> _GGUF:
    """Metadata and tensor views (memory-mapped, not yet copied) of a little-endian GGUF v2/v3."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cursor = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (big-endian or too old?)")
        n_tensors, n_values = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata = {}
        for _ in range(n_values):
            key = cursor.string()
            value = cursor.value(cursor.scalar("<I"))
            if value is not None:
                metadata[key] = value
        infos = [_tensor_info(cursor) for _ in range(n_tensors)]
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-cursor.pos // alignment) * alignment
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {name: _tensor(name, shape, kind, data, data_start + offset) for name, shape, kind, offset in infos}
    if len(tensors) != len(infos):
        raise ValueError(f"{path}: a tensor name appears twice")
    return _GGUF(metadata, tensors)


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    shape = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
    return name, shape, cursor.scalar("<I"), cursor.scalar("<Q")


def _tensor(name: str, shape: tuple[int, ...], kind: int, data: np.ndarray, start: int) -> _Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    if shape[0] % block:
        raise ValueError(f"tensor {name!r}: rows of {shape[0]} do not split into blocks of {block}")
    row_bytes = shape[0] // block * block_bytes
    rows = int(np.prod(shape[1:], dtype=np.int64))
    raw = data[start : start + rows * row_bytes]
    if raw.size != rows * row_bytes:
        raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
    raw = raw.reshape(*reversed(shape[1:]), row_bytes)
    return _Tensor(name, shape, kind, raw)


def _dequantize(tensor: _Tensor) -> np.ndarray:
    """fp32 values, outermost dimension first (the HF layout), as transformers' loader gets them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(tensor.data, GGMLQuantizationType(tensor.ggml_type))


def _hf_tensor(tensor: _Tensor, hf_name: str, arch: str, config: dict[str, Any]) -> torch.Tensor:
    array = _dequantize(tensor)
    if arch == "gemma3" and tensor.name.endswith("norm.weight"):
        # llama.cpp's converter added 1 to every Gemma norm (q/k norms included); in fp32, as
        # transformers' loader subtracts it, so the two agree bit for bit.
        array = array - np.float32(1.0)
    weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
        weight = _unpermute(weight, heads)
    return weight


def _gguf_config(parsed: _GGUF, arch: str) -> dict[str, Any]:
    metadata, tensors = parsed.metadata, parsed.tensors

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        # A GGUF's tensor shape is innermost first: the embedding is (hidden, vocab).
        "vocab_size": int(get("vocab_size", tensors["token_embd.weight"].shape[-1])),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": "output.weight" not in tensors,
        "use_sliding_window": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(metadata),
    }
    if ROPE_FREQS in tensors:
        config["rope_freq_factors"] = [float(x) for x in _dequantize(tensors[ROPE_FREQS]).reshape(-1)]
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    return config


def _rope_scaling(get: Callable[..., Any]) -> dict[str, Any] | None:
    """RoPE scaling the file states in metadata (linear for Gemma 3 4B+, yarn for some Qwen2):
    passed on as transformers names it, for the forward pass to apply or refuse."""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _eos_token_ids(metadata: dict[str, Any]) -> int | list[int] | None:
    """The EOS id, plus the end-of-turn id where the file names another one (a chat model stops
    on either)."""
    ids = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
    unique = list(dict.fromkeys(i for i in ids if i is not None))
    return None if not unique else unique[0] if len(unique) == 1 else unique


def _gemma3_config(get: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma3TextConfig fields the file leaves implicit, as llama.cpp fills them in."""
    window = get("attention.sliding_window")
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",  # llama.cpp's gemma3 graph: tanh-approximated GELU
        "query_pre_attn_scalar": _gemma3_query_scalar(get, config),
        "sliding_window": window,
        "layer_types": _gemma3_layer_types(get("attention.sliding_window_pattern"), layers, bool(window)),
        "rope_local_base_freq": float(get("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE)),
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
    }


def _gemma3_query_scalar(get: Callable[..., Any], config: dict[str, Any]) -> float:
    """Queries are scaled by 1/sqrt(query_pre_attn_scalar): the file's attention.scale where it
    has one; else llama.cpp's rule, head_dim except for the 27B model, whose Google config says
    hidden_size / heads (168)."""
    scale = get("attention.scale")
    if scale:
        return 1.0 / scale**2
    if config["num_hidden_layers"] == _GEMMA3_27B_LAYERS:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma3_layer_types(pattern: Any, layers: int, has_window: bool) -> list[str]:
    """Which layers attend to a sliding window: a per-layer list of flags or a period in the
    file, else llama.cpp's fixed period; none without a window."""
    if not has_window:
        return ["full_attention"] * layers
    if isinstance(pattern, list):
        sliding = [bool(flag) for flag in pattern]
    else:
        period = int(pattern or _GEMMA3_SLIDING_PERIOD)
        sliding = [(layer + 1) % period != 0 for layer in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _hf_name(name: str, arch: str) -> str:
    layer_names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match:
        layer, part, kind = match.groups()
        if part not in layer_names:
            raise ValueError(f"unexpected GGUF tensor {name!r} for architecture {arch!r}")
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    base, kind = name.rsplit(".", 1)
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    # Inverse of llama.cpp's view(heads, 2, half, -1).swapaxes(1, 2).
    return weight.view(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)
