"""Read a GGUF file (llama.cpp's format) into a Hugging Face style config and state dict.

Quantised tensors (K-quants included) are dequantised with the `gguf` package. What llama.cpp's
converter changed on the way in is undone, so the tensors equal what transformers' own GGUF
loader gives:
- llama-architecture q/k projections are stored permuted for llama.cpp's interleaved RoPE; they
  are permuted back so the usual half-split RoPE applies (no other architecture is permuted).
- Gemma norm weights are stored with 1 added (llama.cpp scales by w, Gemma's RMSNorm by 1 + w).
- Llama 3.1+ RoPE scaling is stored as a `rope_freqs` tensor of per-frequency divisors, not as
  metadata; it goes into the config as `rope_freq_factors`, not into the state dict.

The header and config come from `tokenmill.formats` (not `gguf.GGUFReader`, which decodes the
whole vocabulary: seconds per load); the tensors are memory-mapped views of the file until dequantised.
Asked to keep weights quantised (`weight_format`, models/quant.py), the linear weights come out as
`Quantized` blocks instead, straight from the file's blocks where their type allows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.formats.gguf_config import ROPE_FREQS, gguf_config
from tokenmill.formats.gguf_header import GGUFHeader, TensorInfo, dequantize, file_bytes, read_gguf_header, tensor_bytes
from tokenmill.models.quant import Quantized, Weight, fits_kernel, from_gguf_blocks, quantize, target_bits

# The GGUF `general.architecture` names read here (config.py's SUPPORTED_ARCHITECTURES lists the
# transformers model_types the forward runs).
GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma3")

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


def read_gguf(path: Path, weight_format: str = "fp32") -> tuple[dict[str, Any], dict[str, Weight]]:
    """(HF-style config dict, HF-named state dict) of a GGUF file: fp32 tensors, and `Quantized`
    linear weights where `weight_format` (models/quant.py WEIGHT_FORMATS) keeps them so."""
    header = read_gguf_header(path)
    refuse_unrunnable(header)
    config = gguf_config(header)
    arch = header.metadata["general.architecture"]
    data = file_bytes(header)
    state_dict: dict[str, Weight] = {}
    for name, info in header.tensors.items():
        if name == ROPE_FREQS:
            continue  # in the config as rope_freq_factors
        target = hf_tensor_name(name, arch)
        bits = target_bits(weight_format, target, info.type_name, len(info.shape))
        if bits is None or not fits_kernel(*reversed(info.shape)):
            state_dict[target] = _hf_tensor(info, data, target, arch, config)
        else:
            state_dict[target] = _hf_quantized(info, data, target, arch, config, bits)
    return config, state_dict


def refuse_unrunnable(header: GGUFHeader) -> None:
    """ValueError for what read_gguf cannot turn into a state dict, found from the header alone:
    an architecture not in GGUF_ARCHITECTURES, or a tensor it has no transformers name for."""
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{header.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    for name in header.tensors:
        if name != ROPE_FREQS:
            hf_tensor_name(name, arch)


def _hf_tensor(info: TensorInfo, data: np.ndarray, hf_name: str, arch: str, config: dict[str, Any]) -> torch.Tensor:
    array = dequantize(info, data)
    if arch == "gemma3" and info.name.endswith("norm.weight"):
        # llama.cpp's converter added 1 to every Gemma norm (q/k norms included); in fp32, as
        # transformers' loader subtracts it, so the two agree bit for bit.
        array = array - np.float32(1.0)
    weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
    heads = _permuted_heads(hf_name, arch, config)
    return weight if heads is None else _unpermute(weight, heads)


def _permuted_heads(hf_name: str, arch: str, config: dict[str, Any]) -> int | None:
    """The heads of a q/k projection llama.cpp stored permuted (llama architecture only), else None."""
    if arch != "llama" or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return None
    return config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]


def _hf_quantized(info: TensorInfo, data: np.ndarray, hf_name: str, arch: str, config: dict[str, Any],
                  bits: int) -> Quantized:
    """The weight as `bits`-bit blocks: the file's own where its type maps exactly, otherwise
    quantised from its fp32 values."""
    n, k = info.shape[1], info.shape[0]  # GGUF shapes are innermost first
    blocks = from_gguf_blocks(tensor_bytes(info, data), info.type_name, n, k)
    quantized = None if blocks is None else blocks.exactly_as(bits)
    if quantized is None:
        return quantize(_hf_tensor(info, data, hf_name, arch, config), bits)
    heads = _permuted_heads(hf_name, arch, config)
    return quantized if heads is None else quantized.permute_rows(_unpermute(torch.arange(n)[:, None], heads)[:, 0])


def hf_tensor_name(name: str, arch: str) -> str:
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
