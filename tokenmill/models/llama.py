"""A Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) written for a paged KV cache.

Read top to bottom: the step's tokens arrive flattened (no batch padding in the linear
layers); each layer writes its new K/V into cache slots, then attends per request group over
K/V gathered from the cache by block table. Parameter names match Hugging Face's, so a
safetensors checkpoint loads as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.config import ModelConfig, rope_inv_freq
from tokenmill.models.paged_attention import paged_decode_attention


@dataclass
class AttentionGroup:
    """Requests attended together: queries padded to [G, Lq], context padded to [G, Lk]."""

    query_index: torch.Tensor  # [G, Lq] rows of the flat token batch (padding: any row)
    query_valid: torch.Tensor  # [G, Lq] bool
    context_blocks: torch.Tensor  # [G, NB] block tables (padding: the zeroed null block)
    context_lens: torch.Tensor  # [G] keys at positions < len are context
    # [G, 1, group*Lq, NB*block_size] bool, repeated for the query-head group; None when the
    # group is decodes attended by the paged kernel, which reads context_lens instead.
    mask: torch.Tensor | None
    output_rows: torch.Tensor  # query_index[query_valid]
    covers_batch: bool = False  # the group is every row of the batch, in order (pure decode)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot (block * block_size + offset) of each new token's K/V
    groups: list[AttentionGroup]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D] (the half-split layout of Hugging Face Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.group = self.num_heads // self.num_kv_heads
        self.sliding_window = cfg.sliding_window
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM (see fuse_projections): fewer, larger matmuls per step.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)

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
        # q and k heads sit side by side: rotate them in one go.
        qk = apply_rope(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        k_cache, v_cache = kv_cache  # [blocks, block_size, kv_heads, head_dim]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        if len(meta.groups) == 1 and meta.groups[0].covers_batch:  # skip the scatter
            return self.o_proj(self._attend(q, k_cache, v_cache, meta.groups[0]).reshape(tokens, -1))
        out = torch.empty_like(q)
        for g in meta.groups:
            out[g.output_rows] = self._attend(q, k_cache, v_cache, g)
        return self.o_proj(out.view(tokens, -1))

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup
    ) -> torch.Tensor:
        if g.mask is None:  # decodes, straight from the paged cache
            rows = q if g.covers_batch else q[g.output_rows]
            return paged_decode_attention(
                rows, k_cache, v_cache, g.context_blocks, g.context_lens, self.sliding_window
            )
        n, lq = g.query_index.shape
        kvh, grp, d = self.num_kv_heads, self.group, self.head_dim
        # Fold the query heads that share a KV head into the query length: GQA without
        # copying K/V once per query head.
        qg = (q if g.covers_batch else q[g.query_index]).view(n, lq, kvh, grp, d).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(n, kvh, grp * lq, d)
        # Gather whole blocks (one contiguous copy each), not token slots: ~5x faster here.
        blocks = g.context_blocks.flatten()
        kg = k_cache.index_select(0, blocks).view(n, -1, kvh, d).transpose(1, 2)  # [G, KVH, Lk, D]
        vg = v_cache.index_select(0, blocks).view(n, -1, kvh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask)
        o = o.view(n, kvh, grp, lq, d).permute(0, 3, 1, 2, 4).reshape(n, lq, kvh * grp, d)
        return o.view(n, kvh * grp, d) if g.covers_batch else o[g.query_valid]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this model's: q/k/v and gate/up weights concatenated."""
    parts = {part for group in _FUSED.values() for part in group}
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        prefix, _, rest = name.partition(".layers.")
        layer, _, module = rest.partition(".")
        module_path, _, kind = module.rpartition(".")
        if module_path not in parts:
            fused[name] = tensor
            continue
        for target, group in _FUSED.items():
            if module_path == group[0]:
                sources = [f"{prefix}.layers.{layer}.{g}.{kind}" for g in group]
                fused[f"{prefix}.layers.{layer}.{target}.{kind}"] = torch.cat([state_dict[s] for s in sources])
    return fused


class CausalLM(nn.Module):
    rope_cos: torch.Tensor  # [max_positions, head_dim], set by init_rope
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, max_positions: int) -> None:
        """cos/sin tables for every position (built after weights load: they are not weights)."""
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(self.config))
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,  # [S] rows whose next-token logits are wanted
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.lm_head(self.model.norm(x[logits_rows])).float()
