"""Read a GGUF file (llama.cpp's format) into a Hugging Face style config and state dict.

Quantised tensors are dequantised with the `gguf` package. llama.cpp stores the q/k
projections of llama-architecture models permuted for its interleaved RoPE; they are
permuted back here so the usual half-split RoPE applies.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(HF-style config dict, HF-named fp32 state dict) of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF rope frequency factors (rope_freqs) are not supported")
    config = _gguf_config(reader, arch, tie="output.weight" not in names)
    state_dict = {}
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        name = _hf_name(tensor.name)
        weight = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            weight = _unpermute(weight, heads)
        state_dict[name] = weight
    return config, state_dict


def _gguf_config(reader: Any, arch: str, tie: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "model_type": arch,
        "vocab_size": int(get("vocab_size", embed.shape[-1])),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": tie,
        "use_sliding_window": False,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _hf_name(name: str) -> str:
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if match:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    base, kind = name.rsplit(".", 1)
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"{_GLOBAL_NAMES[base]}.{kind}"


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    # Inverse of llama.cpp's view(heads, 2, half, -1).swapaxes(1, 2).
    return weight.view(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)
