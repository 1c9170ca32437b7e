"""Model architecture specs: presets, Hugging Face config.json and GGUF readers, param counts.

Everything the roofline needs is derived from the architecture numbers (layers, widths, heads,
experts), never from hard-coded parameter totals, so a wrong preset shows up as a wrong total in
the tests instead of silently skewing every plan.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.environment import embedded_model_path
from tokenmill.formats.gguf_config import gguf_config
from tokenmill.formats.gguf_header import GGUFHeader, TensorInfo, read_gguf_header

from .dtypes import WeightWidths
from .errors import PlanError


@dataclass(frozen=True)
class MoESpec:
    """Routed mixture-of-experts MLP. Every expert is a gated MLP (3 matrices of d x ffn)."""

    num_experts: int  # routed experts per MoE layer
    top_k: int  # routed experts each token uses
    expert_ffn: int  # intermediate size of one routed expert
    num_moe_layers: int  # the other layers use the dense MLP of ModelSpec.ffn_size
    num_shared_experts: int = 0  # always-on experts (DeepSeek, Llama 4)
    shared_ffn: int = 0  # intermediate size of one shared expert


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention: the KV cache holds one compressed latent per token."""

    q_lora_rank: int  # 0 = queries are not compressed
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as much of it as throughput physics needs."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int  # intermediate size of the dense (non-MoE) gated MLP
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    default_weight_dtype: str = "bf16"  # the dtype the checkpoint ships in
    native_widths: WeightWidths | None = None  # stored bytes/param by role (GGUF files)
    max_context: int | None = None
    source: str = ""


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by role; the roofline needs to know which weights a step reads."""

    embedding: int  # input token table (a lookup: B rows read per step, not the whole table)
    lm_head: int  # 0 when tied to the embedding
    attention: int
    dense_mlp: int
    shared_experts: int
    routed_experts: int  # all routed experts of all layers
    router: int
    norms: int
    expert_params: int  # one routed expert of one layer
    num_moe_layers: int
    top_k: int

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.blocks

    @property
    def blocks(self) -> int:
        """The transformer blocks (and final norm): what quantisation applies to."""
        return (self.attention + self.dense_mlp + self.shared_experts + self.routed_experts
                + self.router + self.norms)

    @property
    def output_projection(self) -> int:
        """The matrix that turns hidden states into logits: the lm_head, or the embedding table
        when the two are tied."""
        return self.lm_head if self.lm_head else self.embedding

    @property
    def active(self) -> int:
        """Parameters one token uses: routed experts count only top_k per MoE layer."""
        used = self.num_moe_layers * self.top_k * self.expert_params
        return self.total - self.routed_experts + used

    @property
    def matmul_active(self) -> int:
        """Parameters one token multiplies by (FLOPs = 2 x this): no embedding lookup or norms,
        but always an output projection (the tied embedding when there is no lm_head)."""
        return self.active - self.embedding - self.lm_head - self.norms + self.output_projection


def _attention_params(m: ModelSpec) -> int:
    d = m.hidden_size
    if m.mla is not None:
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = d * m.num_heads * qk if not a.q_lora_rank else (
            d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_heads * qk)
        kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv += a.kv_lora_rank * m.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return q + kv + m.num_heads * a.v_head_dim * d
    q_dim, kv_dim = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    bias = (q_dim + 2 * kv_dim) if m.qkv_bias else 0
    return d * q_dim + 2 * d * kv_dim + q_dim * d + bias


def param_counts(m: ModelSpec) -> ParamCounts:
    """Count parameters from the architecture (gated MLPs: 3 matrices; 2 RMSNorms per layer)."""
    d, L = m.hidden_size, m.num_layers
    moe = m.moe
    n_moe = moe.num_moe_layers if moe else 0
    expert = 3 * d * moe.expert_ffn if moe else 0
    return ParamCounts(
        embedding=m.vocab_size * d,
        lm_head=0 if m.tie_embeddings else m.vocab_size * d,
        attention=L * _attention_params(m),
        dense_mlp=(L - n_moe) * 3 * d * m.ffn_size,
        shared_experts=n_moe * moe.num_shared_experts * 3 * d * moe.shared_ffn if moe else 0,
        routed_experts=n_moe * moe.num_experts * expert if moe else 0,
        router=n_moe * d * moe.num_experts if moe else 0,
        norms=(2 * L + 1) * d,
        expert_params=expert,
        num_moe_layers=n_moe,
        top_k=moe.top_k if moe else 0,
    )


def kv_elements_per_token(m: ModelSpec) -> int:
    """KV-cache elements one token adds, over all layers.

    Standard/GQA attention caches K and V per KV head: 2 x layers x kv_heads x head_dim.
    MLA caches one latent (kv_lora_rank) plus the shared RoPE key (qk_rope_head_dim) per layer,
    with no separate K and V, hence no factor 2.
    """
    if m.mla is not None:
        return (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * m.num_layers
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim


def attention_flops_per_context_token(m: ModelSpec, phase: str) -> int:
    """FLOPs one new token spends per cached token it attends to (QK^T plus AV), all layers.

    MLA decode runs in the "absorbed" form (scores and values in the 512-d latent space): that is
    what reading only the compressed cache implies. MLA prefill materialises per-head K/V once
    (their projection FLOPs are in the parameter count) and attends in the smaller per-head dims.
    """
    L, H = m.num_layers, m.num_heads
    if m.mla is None:
        return 4 * L * H * m.head_dim
    a = m.mla
    if phase == "decode":
        return 2 * L * H * (a.kv_lora_rank + a.qk_rope_head_dim) + 2 * L * H * a.kv_lora_rank
    return 2 * L * H * (a.qk_nope_head_dim + a.qk_rope_head_dim) + 2 * L * H * a.v_head_dim


# --- Hugging Face config.json -------------------------------------------------------------


def _widest(value: Any) -> Any:
    """A size given per layer (a GGUF's head_count_kv may be): plan for the widest layer."""
    return max(value) if isinstance(value, list) else value


def _need(cfg: dict[str, Any], key: str, source: str) -> int:
    value = _widest(cfg.get(key))
    if value is None:
        raise PlanError("model", f"{source}: config has no {key!r}")
    return int(value)


def _default_dtype(cfg: dict[str, Any]) -> str:
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if quant.get("bits") == 4 or method in ("awq", "gptq"):
        return "int4"
    if quant.get("bits") == 8:
        return "int8"
    torch_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    return {"float16": "fp16", "float32": "fp32"}.get(torch_dtype, "bf16")


def _moe_from_hf(cfg: dict[str, Any], num_layers: int, source: str) -> MoESpec | None:
    num_experts = cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get(
        "num_experts")
    if not num_experts:
        return None
    model_type = cfg.get("model_type", "")
    expert_ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    # Shared experts: DeepSeek counts them (each of the routed size), Qwen-MoE gives its one
    # expert's width, a GGUF may give both; Llama 4 has one of the routed size.
    shared = int(cfg.get("n_shared_experts") or 0)
    shared_ffn = int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared_ffn and not shared:
        shared = 1
    elif shared and not shared_ffn:
        shared_ffn = expert_ffn
    elif not shared and model_type.startswith("llama4"):
        shared, shared_ffn = 1, expert_ffn
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    step = int(cfg.get("interleave_moe_layer_step") or cfg.get("moe_layer_freq") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])  # by number (Qwen-MoE, and a GGUF's layers without experts)
    n_moe = sum((layer - first_dense + 1) % step == 0 and layer not in dense
                for layer in range(first_dense, num_layers))
    return MoESpec(num_experts=int(num_experts), top_k=_need(cfg, "num_experts_per_tok", source),
                   expert_ffn=expert_ffn, num_moe_layers=n_moe,
                   num_shared_experts=shared, shared_ffn=shared_ffn)


def spec_from_hf_config(cfg: dict[str, Any], name: str, source: str = "") -> ModelSpec:
    """Build a ModelSpec from a transformers config dict (text_config is used when nested)."""
    source = source or name
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
    layers = _need(cfg, "num_hidden_layers", source)
    hidden = _need(cfg, "hidden_size", source)
    heads = _need(cfg, "num_attention_heads", source)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLASpec(q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                      kv_lora_rank=int(cfg["kv_lora_rank"]),
                      qk_nope_head_dim=_need(cfg, "qk_nope_head_dim", source),
                      qk_rope_head_dim=_need(cfg, "qk_rope_head_dim", source),
                      v_head_dim=_need(cfg, "v_head_dim", source))
    model_type = str(cfg.get("model_type", ""))
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(_widest(cfg.get("num_key_value_heads")) or heads),
        head_dim=int(_widest(cfg.get("head_dim")) or (mla.qk_nope_head_dim + mla.qk_rope_head_dim
                                                      if mla else hidden // heads)),
        ffn_size=int(cfg.get("intermediate_size_mlp") or _need(cfg, "intermediate_size", source)),
        vocab_size=_need(cfg, "vocab_size", source),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias")) or model_type.startswith("qwen2"),
        moe=_moe_from_hf(cfg, layers, source), mla=mla,
        default_weight_dtype=_default_dtype(cfg),
        max_context=cfg.get("max_position_embeddings") or None, source=source,
    )


def read_hf_config(path: Path) -> ModelSpec:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError("model", f"cannot read {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise PlanError("model", f"{path}: not a JSON object")
    name = str(cfg.get("_name_or_path") or path.parent.name or path.stem)
    return spec_from_hf_config(cfg, name=name, source=str(path))


# --- GGUF ---------------------------------------------------------------------------------


def _read_gguf_header(path: Path) -> GGUFHeader:
    try:
        return read_gguf_header(path)
    except OSError as exc:
        raise PlanError("model", f"cannot read GGUF {path}: {exc}") from None
    except ValueError as exc:  # its message names the file
        raise PlanError("model", str(exc)) from None


def _native_widths(header: GGUFHeader) -> WeightWidths:
    """Stored bytes per parameter of the token table, the output matrix and the rest, from the
    tensor types the file states (quantised blocks with their scales). llama.cpp's quantisers
    keep these two at a wider type than the blocks (e.g. Q6_K or Q8_0 beside Q4_K)."""
    def width(tensors: list[TensorInfo]) -> float | None:
        elements = sum(t.n_elements for t in tensors)
        return sum(t.n_bytes for t in tensors) / elements if elements else None

    tables = {"token_embd.weight", "output.weight"}
    blocks = width([t for name, t in header.tensors.items() if name not in tables]) or 0.0
    embd = header.tensors.get("token_embd.weight")
    out = header.tensors.get("output.weight")
    embedding = width([embd]) if embd else None
    lm_head = width([out]) if out else None
    return WeightWidths(embedding=embedding or blocks, lm_head=lm_head or embedding or blocks,
                        blocks=blocks)


def spec_from_gguf(path: Path) -> ModelSpec:
    """Build a ModelSpec from a GGUF file's header: its metadata read as the loader reads it
    (formats.gguf_config), then as any config.json; the real stored bytes of each tensor give
    ``native_widths``."""
    header = _read_gguf_header(path)
    try:
        cfg = gguf_config(header)
    except (KeyError, TypeError, ValueError) as exc:  # metadata of the wrong kind
        raise PlanError("model", f"{path}: GGUF metadata not understood ({exc!r})") from None
    name = str(header.metadata.get("general.name") or path.stem)
    spec = spec_from_hf_config(cfg, name=name, source=str(path))
    return replace(spec, default_weight_dtype="native", native_widths=_native_widths(header))


# --- presets ------------------------------------------------------------------------------
# The config.json fields of the published checkpoints (only those the planner reads), so presets
# go through the same reader as user files. Llama 4 Scout: the text model only (the ~1B vision
# encoder is not part of decode). DeepSeek-V3: without the multi-token-prediction module, in the
# fp8 it ships in.

PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b-instruct": dict(
        model_type="qwen2", num_hidden_layers=28, hidden_size=3584, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=32768, torch_dtype="bfloat16"),
    "phi-4": dict(
        model_type="phi3", num_hidden_layers=40, hidden_size=5120, num_attention_heads=40,
        num_key_value_heads=10, intermediate_size=17920, vocab_size=100352,
        tie_word_embeddings=False, max_position_embeddings=16384, torch_dtype="bfloat16"),
    "qwen2.5-72b-instruct": dict(
        model_type="qwen2", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064,
        tie_word_embeddings=False, max_position_embeddings=32768, torch_dtype="bfloat16"),
    "llama-3.1-70b-instruct": dict(
        model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, intermediate_size=28672, vocab_size=128256,
        tie_word_embeddings=False, max_position_embeddings=131072, torch_dtype="bfloat16"),
    "mixtral-8x7b-instruct": dict(
        model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=32768,
        torch_dtype="bfloat16"),
    "llama-4-scout-17b-16e-instruct": dict(
        model_type="llama4_text", num_hidden_layers=48, hidden_size=5120,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, intermediate_size=8192,
        intermediate_size_mlp=16384, vocab_size=202048, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=1, tie_word_embeddings=False,
        max_position_embeddings=10485760, torch_dtype="bfloat16"),
    "deepseek-v3": dict(
        model_type="deepseek_v3", num_hidden_layers=61, hidden_size=7168,
        num_attention_heads=128, num_key_value_heads=128, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=129280, tie_word_embeddings=False, max_position_embeddings=163840,
        torch_dtype="bfloat16", quantization_config={"quant_method": "fp8"}),
    "smollm2-135m-instruct": dict(
        model_type="llama", num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
        tie_word_embeddings=True, max_position_embeddings=8192, torch_dtype="bfloat16"),
}

# Short names, and the names the published study uses (after normalise_name).
ALIASES = {
    "qwen2.5-7b": "qwen2.5-7b-instruct", "phi-4-14b": "phi-4", "phi4": "phi-4",
    "qwen2.5-72b": "qwen2.5-72b-instruct", "llama-3.1-70b": "llama-3.1-70b-instruct",
    "mixtral-8x7b": "mixtral-8x7b-instruct", "llama-4-scout": "llama-4-scout-17b-16e-instruct",
    "deepseek-v3-671b": "deepseek-v3", "smollm2-135m": "smollm2-135m-instruct",
}


def normalise_name(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", " ").split())


def preset(name: str) -> ModelSpec:
    key = normalise_name(name)
    key = ALIASES.get(key, key)
    if key not in PRESET_CONFIGS:
        known = ", ".join(sorted([*PRESET_CONFIGS, *ALIASES]))
        raise PlanError("model", f"unknown preset {name!r} (known: {known})")
    return spec_from_hf_config(PRESET_CONFIGS[key], name=key, source="preset")


def load_model(ref: str | None) -> ModelSpec:
    """Resolve --model: None (embedded SmolLM2 GGUF), a preset name, a .gguf or config.json
    file, or a folder holding a config.json or exactly one .gguf."""
    if ref is None:
        try:
            return spec_from_gguf(embedded_model_path())
        except FileNotFoundError as exc:
            raise PlanError("model", f"no model given and {exc}; pass a preset name or a file") from None
    path = Path(ref).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return read_hf_config(path / "config.json")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise PlanError("model", f"folder {path} has no config.json and "
                            f"{len(ggufs)} .gguf files (need exactly one)")
        return spec_from_gguf(ggufs[0])
    if path.is_file():
        return spec_from_gguf(path) if path.suffix == ".gguf" else read_hf_config(path)
    if "/" in ref or ref.endswith((".json", ".gguf")):
        raise PlanError("model", f"file or folder {ref!r} does not exist")
    return preset(ref)
