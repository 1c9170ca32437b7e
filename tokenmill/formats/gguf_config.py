"""A GGUF file's metadata as a Hugging Face style config dict: the one mapping from llama.cpp's keys
to transformers' names, read by the model loader (and `tokenmill info`) and by the planner alike.

It states what the file says and leaves defaults to its readers (a key the file lacks is None or
absent), except what llama.cpp itself fills in rather than writing to the file (Gemma 3's fixed
settings). Mixture-of-experts and latent-attention (DeepSeek) sizes come under the names
transformers' configs give them, so both readers see a GGUF like the checkpoint it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .gguf_header import GGUFHeader, TensorInfo, dequantize, file_bytes

# A GGUF architecture whose transformers model_type has another name.
_MODEL_TYPES = {"gemma3": "gemma3_text"}
# Llama 3.1+ RoPE scaling as llama.cpp stores it: a tensor of per-frequency divisors, not metadata.
ROPE_FREQS = "rope_freqs.weight"
# What llama.cpp fixes for Gemma 3 rather than writing to the file (llama-model.cpp).
_GEMMA3_SLIDING_PERIOD = 6  # every 6th layer attends globally, the others to a sliding window
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is not 1/sqrt(head_dim)


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """The HF-style config dict of a GGUF file, from its header: no weight is read (only the small
    rope_freqs tensor where there is one). Per-layer sizes stay lists, as the file has them."""
    metadata, tensors = header.metadata, header.tensors
    arch = str(metadata.get("general.architecture"))

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    config = {
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": _vocab_size(get("vocab_size"), tensors.get("token_embd.weight")),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", _whole_heads(hidden, heads)),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "use_sliding_window": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(metadata),
    }
    if get("context_length") is not None:  # absent: each reader has its own default
        config["max_position_embeddings"] = get("context_length")
    if ROPE_FREQS in tensors:
        factors = dequantize(tensors[ROPE_FREQS], file_bytes(header))
        config["rope_freq_factors"] = [float(x) for x in factors.reshape(-1)]
    if any(name.endswith(".ffn_up_exps.weight") for name in tensors):
        config.update(_experts_config(get, tensors, config["num_hidden_layers"]))
    if get("attention.kv_lora_rank"):
        config.update(_latent_attention_config(get))
    if arch == "gemma3":
        config.update(_gemma3_config(get, config))
    return config


def _vocab_size(stated: Any, embedding: TensorInfo | None) -> int | None:
    """The stated vocabulary, else the token table's width (GGUF shapes are innermost first: the
    embedding is (hidden, vocab))."""
    if stated is not None:
        return int(stated)
    return int(embedding.shape[-1]) if embedding else None


def _whole_heads(hidden: Any, heads: Any) -> int | None:
    """hidden / heads, where the file gives both as single numbers."""
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


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


def _experts_config(get: Callable[..., Any], tensors: dict[str, TensorInfo], layers: Any) -> dict[str, Any]:
    """Routed experts, and the always-on shared ones (a count, DeepSeek; a width, Qwen-MoE; or only
    their tensors, one expert of the routed width). Which layers route is read off the tensors:
    the others are mlp_only_layers, as Qwen-MoE's config lists them."""
    shared = get("expert_shared_count", 1 if "blk.0.ffn_up_shexp.weight" in tensors else 0)
    config = {
        "num_experts": get("expert_count"),
        "num_experts_per_tok": get("expert_used_count"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "mlp_only_layers": [layer for layer in range(layers or 0)
                            if f"blk.{layer}.ffn_up_exps.weight" not in tensors],
    }
    if shared:
        config["n_shared_experts"] = shared
        config["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    return config


def _latent_attention_config(get: Callable[..., Any]) -> dict[str, Any]:
    """DeepSeek's multi-head latent attention: the file's key_length is the whole query/key head,
    the part without RoPE plus the rotated part."""
    key, rope = get("attention.key_length"), get("rope.dimension_count")
    return {
        "q_lora_rank": get("attention.q_lora_rank", 0),
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "qk_nope_head_dim": key - rope if key is not None and rope is not None else None,
        "qk_rope_head_dim": rope,
        "v_head_dim": get("attention.value_length"),
    }


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
