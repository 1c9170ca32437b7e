"""The architecture facts the forward pass needs, read from a Hugging Face config dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.models.moe import is_moe_layer

# "gemma3" is the multimodal config: its text part (text_config) is what runs.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3", "gemma3_text", "gemma3", "phi3", "mixtral",
                           "qwen2_moe", "qwen3_moe")
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Gemma3TextConfig's defaults: a multimodal config's text_config lists only what differs from them.
_GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}


@dataclass
class ModelConfig:
    model_type: str  # "gemma3" configs are read as "gemma3_text"
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
    # transformers' rope_parameters less rope_theta (one of ROPE_SCALINGS); None: unscaled.
    rope_scaling: dict[str, Any] | None = None
    # Only the first head_dim * partial_rotary_factor dimensions of each head rotate (Phi-4-mini).
    partial_rotary_factor: float = 1.0
    # llama.cpp's per-frequency RoPE divisors (a GGUF file's rope_freqs tensor, Llama 3.1+):
    # applied instead of rope_scaling when present.
    rope_freq_factors: list[float] | None = None
    # RoPE base of the sliding-window layers (Gemma 3), which also skip rope_scaling; None: one
    # RoPE table for every layer.
    rope_local_theta: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2 always has it)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the MLP gate's activation, one of ACTIVATIONS
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma 3); None: head_dim's.
    query_pre_attn_scalar: float | None = None
    # The window every layer attends within (Mistral). None where some layer sees its whole
    # context: the runner builds each step's masks with this one window.
    sliding_window: int | None = None
    # Each layer's window (None: whole context) where layers differ (Gemma 3, Qwen with
    # max_window_layers); empty: every layer uses sliding_window.
    layer_windows: list[int | None] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; models/moe.py); num_experts 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's (Mixtral: intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (Mixtral always does)
    decoder_sparse_step: int = 1  # every step-th layer is sparse ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; tokenmill runs {SUPPORTED_ARCHITECTURES}"
            )
        if model_type in ("gemma3", "gemma3_text"):
            cfg = _gemma3_text(cfg)
            model_type = "gemma3_text"
        heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial_rotary = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
        rope_type = rope["rope_type"]
        windows = _layer_windows(cfg)
        eos = cfg.get("eos_token_id")
        factors, local_theta = cfg.get("rope_freq_factors"), cfg.get("rope_local_base_freq")
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
            partial_rotary_factor=partial_rotary,
            rope_freq_factors=None if factors is None else [float(f) for f in factors],
            rope_local_theta=None if local_theta is None else float(local_theta),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
            mlp_bias=cfg.get("mlp_bias", False),
            hidden_act=_activation(cfg),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            sliding_window=windows[0] if len(set(windows)) == 1 else None,
            layer_windows=windows,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            **_moe_fields(cfg),
        )

    @property
    def is_gemma3(self) -> bool:
        """Gemma 3's layout: scaled embeddings, (1 + w) norms, four norms per layer."""
        return self.model_type == "gemma3_text"

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions RoPE rotates (the rest pass through), as transformers
        rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def uses_local_rope(self, layer: int) -> bool:
        """Gemma 3's sliding-window layers rotate with their own, unscaled, RoPE table."""
        return self.rope_local_theta is not None and self.layer_window(layer) is not None

    def is_moe_layer(self, layer: int) -> bool:
        return is_moe_layer(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        # Every layer caches the same num_key_value_heads x head_dim (true of Gemma 3 too).
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings in transformers 5's shape (rope_parameters) from either config shape: older
    configs write rope_scaling, with `type` and a top-level original_max_position_embeddings (Phi-3)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.pop("type", None)
    kind = rope.get("rope_type") or kind or "default"
    rope["rope_type"] = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if rope["rope_type"] not in ("default", *ROPE_SCALINGS):
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
    if "original_max_position_embeddings" not in rope and cfg.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return rope


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts settings, under transformers' names for each family."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    mixtral = cfg.get("model_type") == "mixtral"
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
        "norm_topk_prob": True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": cfg.get("decoder_sparse_step") or 1,
        "mlp_only_layers": list(cfg.get("mlp_only_layers") or []),
    }


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"MLP activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return act


def _layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (None: it attends to its whole context), as transformers decides."""
    layers, model_type = cfg["num_hidden_layers"], cfg.get("model_type")
    window = int(cfg["sliding_window"]) if cfg.get("sliding_window") else None
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        window = window if cfg.get("use_sliding_window", False) else None
        # Only the layers from max_window_layers on slide.
        first = cfg.get("max_window_layers", 28)
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
    elif model_type == "gemma3_text":
        types = cfg["layer_types"]
    else:  # llama, mistral: every layer alike
        return [window] * layers
    if len(types) != layers:
        raise ValueError(f"layer_types lists {len(types)} layers, the model has {layers}")
    return [window if kind == "sliding_attention" else None for kind in types]


def _gemma3_text(cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config in the flat shape from_hf reads: the text part of a multimodal config,
    Gemma3TextConfig's defaults filled in, RoPE split into the full-attention layers' parameters
    and the sliding layers' base, and layer_types derived where absent."""
    if cfg.get("model_type") == "gemma3":
        # The loader puts generation_config.json's EOS ids at the top level: they win.
        top = ("eos_token_id", "bos_token_id", "tie_word_embeddings")
        cfg = {**(cfg.get("text_config") or {}), **{k: cfg[k] for k in top if cfg.get(k) is not None}}
    cfg = {**cfg, "model_type": "gemma3_text"}
    for key, default in _GEMMA3_DEFAULTS.items():
        if cfg.get(key) is None:
            cfg[key] = default
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"Gemma config sets {key}: logit softcapping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma config sets use_bidirectional_attention (an embedding model): not supported")
    per_kind = cfg.get("rope_parameters") or {}
    if "full_attention" in per_kind:  # transformers 5 writes RoPE parameters per layer kind
        full = {"rope_theta": cfg["rope_theta"], **(per_kind["full_attention"] or {})}
        local = per_kind.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma sliding-layer RoPE {local['rope_type']!r} is not supported (only default)")
        cfg["rope_parameters"] = full
        cfg["rope_local_base_freq"] = local.get("rope_theta", cfg["rope_local_base_freq"])
    if not cfg.get("layer_types"):  # every pattern-th layer attends globally
        pattern = cfg["sliding_window_pattern"]
        cfg["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    return cfg


def rope_inv_freq(config: ModelConfig, local: bool = False, context_len: int | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32, computed as transformers does) over the rotary_dim
    dimensions. `local`: the table of Gemma 3's sliding layers, base rope_local_theta and never
    scaled. Otherwise llama.cpp's per-frequency divisors where a GGUF file gave them, else the
    config's scaling. `context_len`: the longest sequence the engine will run (longrope picks its
    factors by it)."""
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    assert theta is not None, "no local RoPE base in this config"
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (theta**exponents)
    if local:
        return inv
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"{factors.numel()} rope_freq_factors for {inv.numel()} RoPE frequencies")
        return inv / factors  # what llama.cpp does with them
    scaling = config.rope_scaling
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3_scale(inv, scaling)
    if kind == "yarn":
        return _yarn_scale(theta, dim, _scaling_factor(config), scaling)
    if kind == "longrope":
        return 1.0 / (_longrope_factors(config, context_len) * theta**exponents)
    raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")


def rope_attention_factor(config: ModelConfig) -> float:
    """What yarn and longrope multiply cos and sin by (so q.k by its square); 1 for the others."""
    scaling = config.rope_scaling or {}
    kind, given = scaling.get("rope_type"), scaling.get("attention_factor")
    if config.rope_freq_factors is not None or kind not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = _scaling_factor(config)
    if kind == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:  # DeepSeek's form
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _scaling_factor(config: ModelConfig) -> float:
    """The context extension: the config's factor, else how far max_position_embeddings goes past
    the pretraining length (Phi-3 states only the two lengths)."""
    scaling = config.rope_scaling or {}
    factor = scaling.get("factor")
    if factor is None:
        return config.max_position_embeddings / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scale(theta: float, dim: int, factor: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: high frequencies kept (extrapolated), low ones divided by `factor` (interpolated),
    a linear ramp between over the dimensions that turn between beta_fast and beta_slow times in
    the pretraining context."""
    old_len = s["original_max_position_embeddings"]
    low = _correction_dim(s.get("beta_fast") or 32, dim, theta, old_len)
    high = _correction_dim(s.get("beta_slow") or 1, dim, theta, old_len)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    kept = 1 - ramp
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


def _correction_dim(rotations: float, dim: int, theta: float, old_len: int) -> float:
    """The dimension whose frequency turns `rotations` times over old_len positions."""
    return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _longrope_factors(config: ModelConfig, context_len: int | None) -> torch.Tensor:
    """Phi-3's per-frequency divisors: long_factor when the engine's context goes past the
    pretraining length, short_factor otherwise. transformers switches per forward call by the
    longest position in it, which makes a request's output depend on what it was batched with;
    llama.cpp decides by the context size, as here."""
    s = config.rope_scaling or {}
    long = context_len is not None and context_len > s["original_max_position_embeddings"]
    factors = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    if factors.numel() != config.rotary_dim // 2:
        raise ValueError(f"longrope lists {factors.numel()} factors for {config.rotary_dim // 2} RoPE frequencies")
    return factors


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
