"""Read a GGUF file (llama.cpp's format) into a Hugging Face style config and state dict.

Quantised tensors (K-quants included) are dequantised with the `gguf` package. What llama.cpp's
converter changed on the way in is undone, so the tensors equal what transformers' own GGUF
loader gives:
- llama-architecture q/k projections are stored permuted for llama.cpp's interleaved RoPE; they
  are permuted back so the usual half-split RoPE applies (no other architecture is permuted).
- Gemma norm weights are stored with 1 added (llama.cpp scales by w, Gemma's RMSNorm by 1 + w).
- Llama 3.1+ RoPE scaling is stored as a `rope_freqs` tensor of per-frequency divisors, not as
  metadata; it goes into the config as `rope_freq_factors`, not into the state dict.

The header comes from `tokenmill.gguf_header` (not `gguf.GGUFReader`, which decodes the whole
vocabulary: seconds per load); the tensors are memory-mapped views of the file until dequantised.
Asked to keep weights quantised (`weight_format`, models/quant.py), the linear weights come out as
`Quantized` blocks instead, straight from the file's blocks where their type allows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.gguf_header import GGUFHeader, TensorInfo, read_gguf_header
from tokenmill.models.quant import Quantized, Weight, fits_kernel, from_gguf_blocks, quantize, target_bits

# The GGUF `general.architecture` names read here (config.py's SUPPORTED_ARCHITECTURES lists the
# transformers model_types the forward runs).
GGUF_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma3")
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


def read_gguf(path: Path, weight_format: str = "fp32") -> tuple[dict[str, Any], dict[str, Weight]]:
    """(HF-style config dict, HF-named state dict) of a GGUF file: fp32 tensors, and `Quantized`
    linear weights where `weight_format` (models/quant.py WEIGHT_FORMATS) keeps them so."""
    header = read_gguf_header(path)
    refuse_unrunnable(header)
    config = gguf_config(header)
    arch = header.metadata["general.architecture"]
    data = _file_bytes(header)
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


def _file_bytes(header: GGUFHeader) -> np.ndarray:
    """The whole file, memory-mapped: tensors are views of it until they are dequantised."""
    return np.memmap(header.path, dtype=np.uint8, mode="r")


def _tensor_bytes(info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """Its bytes, one row per innermost row (what gguf.quants.dequantize takes); not yet copied."""
    raw = data[info.data_offset : info.data_offset + info.n_bytes]
    return raw.reshape(*reversed(info.shape[1:]), info.row_bytes)


def _dequantize(info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """fp32 values, outermost dimension first (the HF layout), as transformers' loader gets them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(_tensor_bytes(info, data), GGMLQuantizationType(info.ggml_type))


def _hf_tensor(info: TensorInfo, data: np.ndarray, hf_name: str, arch: str, config: dict[str, Any]) -> torch.Tensor:
    array = _dequantize(info, data)
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
    blocks = from_gguf_blocks(_tensor_bytes(info, data), info.type_name, n, k)
    quantized = None if blocks is None else blocks.exactly_as(bits)
    if quantized is None:
        return quantize(_hf_tensor(info, data, hf_name, arch, config), bits)
    heads = _permuted_heads(hf_name, arch, config)
    return quantized if heads is None else quantized.permute_rows(_unpermute(torch.arange(n)[:, None], heads)[:, 0])


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The HF-style config dict of a GGUF file, from its header: no weight is read (only the small
    rope_freqs tensor where there is one). Refuses nothing: see refuse_unrunnable."""
    metadata, tensors = header.metadata, header.tensors
    arch = str(metadata.get("general.architecture"))

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
        factors = _dequantize(tensors[ROPE_FREQS], _file_bytes(header))
        config["rope_freq_factors"] = [float(x) for x in factors.reshape(-1)]
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
