"""The decoder-only transformer forward (CausalLM), written for a paged KV cache, for every family
in config.SUPPORTED_ARCHITECTURES: Llama (and SmolLM), Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, and
the mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE (experts from moe.py).

Read top to bottom: the step's tokens arrive flattened (no batch padding in the linear
layers); each layer writes its new K/V into cache slots, then attends per request group
(attention_metadata.py: what the runner builds for a step) over K/V gathered from the cache by
block table, with SDPA and a mask. Parameter names match Hugging Face's, so a safetensors
checkpoint loads as is.

This file is the math, in PyTorch ops only. Where the C kernels run, build.py builds fused.py's
FusedCausalLM instead: these modules with kernels behind some of their steps (norms, RoPE, the
gate, attention read from the paged cache in place, a decode step's layers in one call).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.attention_metadata import AttentionGroup, AttentionMetadata, narrow_to_window
from tokenmill.models.config import ModelConfig, rope_attention_factor, rope_inv_freq
from tokenmill.models.moe import SparseMoE
from tokenmill.models.quant import Quantized, QuantizedLinear, QuantizedParts, Weight, concatenate, quantize

# Prefill queries attended at a time (Attention._attend_in_chunks): smaller leaves out more of the
# masked work, larger makes fewer, bigger SDPA calls. Two 2,048-token prompts measured 540-585
# tok/s in one chunk, 890-950 in chunks of 256 and 1,040 in 128 (Gemma 3 270M); SmolLM2 564, 696-728
# and 723-748 (64: 741).
QUERY_CHUNK = 128


class RMSNorm(nn.Module):
    """`unit_offset` (Gemma): the scale is 1 + weight, added in fp32 at every call as transformers
    does. Folding 1 + w into the stored weight at load time would round it to the model dtype
    (in bf16, to steps of 1/128 around 1), so the checkpoint's w is kept as is."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            scale = 1.0 + self.weight if self.unit_offset else self.weight
            return F.rms_norm(x, (x.shape[-1],), scale, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma scales in fp32, then casts
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)  # Llama casts, then scales


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, R] (the half-split layout of Hugging Face Llama). With
    partial rotary (R < D) only the first R dimensions of each head turn."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    half = rotary // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.sliding_window = sliding_window  # this layer's: Gemma 3 mixes sliding and global layers
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM (see fuse_projections): fewer, larger matmuls per step.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        # Qwen2's attention_bias is on q/k/v only; the other families bias o_proj with it too.
        o_bias = cfg.attention_bias and cfg.model_type not in ("qwen2", "qwen2_moe")
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head of q and k normalised before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=cfg.is_gemma3)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=cfg.is_gemma3)
        # The paged kernel and SDPA scale scores by 1/sqrt(head_dim). Gemma 3 wants
        # 1/sqrt(query_pre_attn_scalar): q is pre-multiplied by the ratio so both stay as they are.
        scalar = cfg.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None else (self.head_dim / scalar) ** 0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        # q and k heads sit side by side: rotate them in one go.
        q, k = self.rotate(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k_cache, v_cache = kv_cache  # [blocks, block_size, kv_heads, head_dim], maybe narrower than q
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        if len(meta.groups) == 1 and meta.groups[0].covers_batch:  # skip the scatter
            return self.o_proj(self.attend(q, k_cache, v_cache, meta.groups[0]).reshape(tokens, -1))
        out = torch.empty_like(q)
        for g in meta.groups:
            self.attend_into(out, q, k_cache, v_cache, g)
        return self.o_proj(out.view(tokens, -1))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def attend_into(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup
    ) -> None:
        """Writes group g's rows of `out`."""
        out[g.output_rows] = self.attend(q, k_cache, v_cache, g)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        """Group g's attention output, by SDPA over the K/V blocks of its block table."""
        n, lq = g.query_index.shape
        kvh, grp, d = self.num_kv_heads, self.group, self.head_dim
        # Fold the query heads that share a KV head into the query length: GQA without
        # copying K/V once per query head.
        qg = (q if g.covers_batch else q[g.query_index]).view(n, lq, kvh, grp, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(n, kvh, grp * lq, d)
        # Gather whole blocks (one contiguous copy each), not token slots: ~5x faster here.
        blocks = g.context_blocks.flatten()
        kg = k_cache.index_select(0, blocks).to(q.dtype).view(n, -1, kvh, d).transpose(1, 2)  # [G, KVH, Lk, D]
        vg = v_cache.index_select(0, blocks).to(q.dtype).view(n, -1, kvh, d).transpose(1, 2)
        # A window the group's mask does not carry has its own, narrowed one.
        mask = g.window_masks.get(self.sliding_window, g.mask) if self.sliding_window else g.mask
        assert mask is not None, "a group without a mask is for the paged kernels (fused.FusedAttention)"
        if lq <= QUERY_CHUNK:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
        else:
            o = self._attend_in_chunks(qg, kg, vg, mask, g)
        o = o.view(n, kvh, grp, lq, d).permute(0, 3, 1, 2, 4).reshape(n, lq, kvh * grp, d)
        return o.view(n, kvh * grp, d) if g.covers_batch else o[g.query_valid]

    def _attend_in_chunks(self, qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, mask: torch.Tensor,
                          g: AttentionGroup) -> torch.Tensor:
        """SDPA over QUERY_CHUNK queries at a time, each against only the keys its mask can let in:
        none past its last query (causal), none a window behind its first (a sliding layer). A
        mask cannot make SDPA skip work, so one 2,048-token chunk computed every query against
        every key; in chunks the causal half (and a sliding layer's band) is mostly left out."""
        n, kvh, rows, d = qg.shape
        grp, lq = self.group, rows // self.group
        first = g.context_lens - g.query_valid.sum(1)  # each request's first query position
        queries, masks = qg.view(n, kvh, grp, lq, d), mask.view(n, 1, grp, lq, -1)
        out = []
        for a in range(0, lq, QUERY_CHUNK):
            b = min(a + QUERY_CHUNK, lq)
            hi = min(int((first + b).max()), kg.shape[2])
            lo = max(0, int((first + a).min()) - self.sliding_window + 1) if self.sliding_window else 0
            # A padded query row's mask lets in key 0 only (no NaNs); past `lo` it would see none.
            lo = lo if bool(g.query_valid[:, a:b].all()) else 0
            o = F.scaled_dot_product_attention(
                queries[:, :, :, a:b].reshape(n, kvh, grp * (b - a), d), kg[:, :, lo:hi], vg[:, :, lo:hi],
                attn_mask=masks[:, :, :, a:b, lo:hi].reshape(n, 1, grp * (b - a), hi - lo))
            out.append(o.view(n, kvh, grp, b - a, d))
        return torch.cat(out, dim=3).view(n, kvh, rows, d)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),  # Gemma
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.activation = cfg.hidden_act
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_up_proj(x)))

    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) · up, from the fused projection's output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cfg.layer_window(layer))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.norm_topk_prob, cfg.shared_expert_intermediate_size,
        ) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.local_rope = cfg.uses_local_rope(layer)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3 also normalises each sublayer's output, before its residual add: four norms.
    (post_attention_layernorm is the attention output's norm here, not the MLP input's.)"""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, cfg.layer_window(layer))
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = norm()
        self.local_rope = cfg.uses_local_rope(layer)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        layer_type = Gemma3DecoderLayer if cfg.is_gemma3 else DecoderLayer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_type(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.is_gemma3)


FUSED_PROJECTIONS = {  # this model's fused linear -> the Hugging Face projections it stacks
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict[str, Weight]) -> dict[str, Weight]:
    """Hugging Face names -> this model's: q/k/v and gate/up weights concatenated."""
    parts = {part for group in FUSED_PROJECTIONS.values() for part in group}
    fused: dict[str, Weight] = {}
    for name, tensor in state_dict.items():
        prefix, _, rest = name.partition(".layers.")
        layer, _, module = rest.partition(".")
        module_path, _, kind = module.rpartition(".")
        if module_path not in parts:
            fused[name] = tensor
            continue
        for target, group in FUSED_PROJECTIONS.items():
            if module_path == group[0]:
                sources = [f"{prefix}.layers.{layer}.{g}.{kind}" for g in group]
                fused[f"{prefix}.layers.{layer}.{target}.{kind}"] = _concatenate([state_dict[s] for s in sources])
    return fused


def _concatenate(parts: list[Weight]) -> Weight:
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    # A fused group is quantised as a whole: a float part (rare in a quantised file) joins at 8 bits.
    assert not any(isinstance(p, QuantizedParts) for p in parts), "parts are made here, from single weights"
    return concatenate([p if isinstance(p, Quantized) else quantize(p, 8) for p in parts])  # type: ignore[arg-type]


class CausalLM(nn.Module):
    rope_cos: torch.Tensor  # [max_positions, rotary_dim], set by init_rope
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor  # the sliding layers' table, where they have their own (Gemma 3)
    rope_local_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # or QuantizedLinear
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Layer windows the runner's masks do not carry (it applies cfg.sliding_window only).
        windows = {cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}
        self.narrowed_windows = sorted(w for w in windows - {cfg.sliding_window} if w is not None)

    def init_rope(self, max_positions: int) -> None:
        """cos/sin tables for every position (built after weights load: they are not weights)."""
        inv_freq = rope_inv_freq(self.config, context_len=max_positions)
        self._register_rope("rope", inv_freq, max_positions, rope_attention_factor(self.config))
        if self.config.rope_local_theta is not None:
            self._register_rope("rope_local", rope_inv_freq(self.config, local=True), max_positions)

    def _register_rope(self, name: str, inv_freq: torch.Tensor, max_positions: int, scale: float = 1.0) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer(f"{name}_cos", angles.cos() * scale, persistent=False)
        self.register_buffer(f"{name}_sin", angles.sin() * scale, persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [S] rows whose next-token logits are wanted
        logits_out: torch.Tensor | None = None,  # [>= S, vocab] fp32: where to write them, if it can
    ) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, kv_caches, meta, logits_rows)
        head = self.lm_head
        if logits_out is not None and isinstance(head, QuantizedLinear) and logits_out.shape[1] == head.out_features:
            return head(hidden, out=logits_out[: len(logits_rows)])
        return head(hidden).float()

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        rows: torch.Tensor,  # [S] rows whose final (normed) states are wanted
    ) -> torch.Tensor:
        """[S, hidden]: what the head reads (and what an embedding model pools)."""
        x = self.model.embed_tokens(input_ids)
        if self.config.is_gemma3:  # by sqrt(hidden_size), first rounded to the dtype as transformers does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        rope = self._rope("rope", positions, x.dtype)
        local_rope = self._rope("rope_local", positions, x.dtype) if self.config.rope_local_theta is not None else rope
        self._add_window_masks(meta)
        x = self.run_layers(x, rope, local_rope, kv_caches, meta)
        return self.model.norm(x[rows])

    def run_layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor],  # the local layers' (the same where none has one)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            cos, sin = local_rope if layer.local_rope else rope
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def _rope(self, name: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{name}_cos")[positions].to(dtype), getattr(self, f"{name}_sin")[positions].to(dtype)

    def _add_window_masks(self, meta: AttentionMetadata) -> None:
        """Each group's mask narrowed to the layer windows it does not carry, once per step."""
        query_group = self.config.num_attention_heads // self.config.num_key_value_heads
        for g in meta.groups:
            if g.mask is not None:
                g.window_masks = {w: narrow_to_window(g, w, query_group) for w in self.narrowed_windows}
