"""The architecture facts the forward pass needs, read from a Hugging Face config dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always has it)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; tokenmill runs {SUPPORTED_ARCHITECTURES}"
            )
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    window = cfg.get("sliding_window")
    return int(window) if window else None


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, computed as transformers does), with Llama-3 or linear
    scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3_scale(inv, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: linear, llama3)")


def _llama3_scale(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Low frequencies are slowed by `factor`, high ones kept, the band between blended.
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)
