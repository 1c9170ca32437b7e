"""A decode step's decoder layers in one C call (csrc/decode_layers.c), for the models it covers.

The layer-by-layer forward makes ~17 Python calls per layer (Gemma 3's, ~25); at batch 1 their
overhead cost more than the matmuls. The C stack runs the same kernel bodies in the same order
(bitwise the same result), so fused.FusedCausalLM takes it for every step of decodes only, where it applies:
dense layers (no MoE) with a SiLU or tanh-GELU gate whose linear layers are all quantised, on a
CPU where the kernels build. Llama, Mistral, Qwen2, Phi-3, Qwen3 (per-head q/k norms) and Gemma 3
(four norms scaling by 1 + w, a query scalar, a local RoPE table on sliding layers) fit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from tokenmill.models import kernels
from tokenmill.models.decoder import MLP, DecoderLayer, Gemma3DecoderLayer
from tokenmill.models.quant import QuantizedLinear, StackedQuantizedLinear, kernel_available

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The layers the stack reads its weights and shapes from: decoder.py's (fused.py's subclass their
# modules and hold the same state).
Layer = DecoderLayer | Gemma3DecoderLayer


class StackLayer(NamedTuple):
    """A layer the C stack covers, with the parts of it that are narrower than Layer says."""

    layer: Layer
    mlp: MLP  # not a mixture of experts
    linears: tuple[QuantizedLinear | StackedQuantizedLinear, ...]  # as _PROJECTIONS


class DecodeStack:
    def __init__(self, layers: Sequence[StackLayer], rotary_dim: int) -> None:
        self._args = (kernels.DecodeLayer * len(layers))()
        for args, (layer, _, linears) in zip(self._args, layers, strict=True):
            attn = layer.self_attn
            args.input_norm = layer.input_layernorm.weight.data_ptr()
            args.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            if attn.q_norm is not None and attn.k_norm is not None:
                args.q_norm, args.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            if isinstance(layer, Gemma3DecoderLayer):  # the sandwich norms
                args.ffn_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
                args.post_ffn_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            for name, linear in zip(_PROJECTIONS, linears, strict=True):
                setattr(args, name, linear.kernel_args())
            args.window = attn.sliding_window or 0
            args.local_rope = int(layer.local_rope)
        first, norm, mlp = layers[0].layer.self_attn, layers[0].layer.input_layernorm, layers[0].mlp
        self._shape = kernels.DecodeShape(
            num_layers=len(layers), hidden=norm.weight.shape[0], heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=first.head_dim, rotary=rotary_dim,
            intermediate=mlp.down_proj.in_features, eps=norm.eps, attention_scale=first.head_dim**-0.5,
            norm_offset=float(norm.unit_offset), activation=kernels.GATED_ACTIVATIONS[mlp.activation],
            q_scale=first.q_scale,
        )
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def build(cls, layers: Sequence[nn.Module], rotary_dim: int) -> DecodeStack | None:
        """The stack for these layers, or None where the C kernel does not cover them. A layer that
        is none of decoder.py's is a TypeError: the stack could not know what it computes."""
        covered = [c for c in (_stack_layer(_layer(i, m)) for i, m in enumerate(layers)) if c is not None]
        # One DecodeShape serves every layer.
        if kernel_available() and len(covered) == len(layers) and len({_shape(c) for c in covered}) == 1:
            return cls(covered, rotary_dim)
        return None

    def __call__(
        self,
        x: torch.Tensor,  # [S, hidden], one new token per sequence: updated in place and returned
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [S, rotary]
        local_rope: tuple[torch.Tensor, torch.Tensor],  # the local layers' (the same where none has one)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,  # [S]
        block_tables: torch.Tensor,  # [S, max_blocks]
        context_lens: torch.Tensor,  # [S]
    ) -> torch.Tensor:
        lib = kernels.library()
        assert lib is not None and x.dtype == torch.float32 and x.is_contiguous()
        if kv_caches is not self._kv_caches:  # the runner passes the same list every step
            for args, (k, v) in zip(self._args, kv_caches, strict=True):
                args.k_cache, args.v_cache = k.data_ptr(), v.data_ptr()
            self._kv_caches = kv_caches
            self._shape.block_size = kv_caches[0][0].shape[1]  # [blocks, block_size, kv_heads, head_dim]
            assert kv_caches[0][0].dtype in kernels.KERNEL_KV_DTYPES, kv_caches[0][0].dtype
            self._shape.kv_half = int(kv_caches[0][0].dtype == torch.float16)
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        cos, sin, cos_local, sin_local = (t.contiguous() for t in (*rope, *local_rope))
        self._shape.max_blocks = tables.shape[1]
        status = lib.decode_layers(
            self._args, ctypes.byref(self._shape), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
            cos_local.data_ptr(), sin_local.data_ptr(), slot_mapping.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"decode_layers failed ({status}): a context empty or longer than its "
                               "block table, or out of memory")
        return x


def _layer(index: int, module: nn.Module) -> Layer:
    if not isinstance(module, DecoderLayer | Gemma3DecoderLayer):
        raise TypeError(f"decode stack: layer {index} is a {type(module).__name__}, not decoder.py's "
                        "DecoderLayer or Gemma3DecoderLayer")
    return module


def _stack_layer(layer: Layer) -> StackLayer | None:
    """`layer` as the stack reads it, or None where the kernel does not cover it."""
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(mlp, MLP):  # a mixture of experts
        return None
    linears = tuple(m for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
                    if isinstance(m, QuantizedLinear | StackedQuantizedLinear))
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if isinstance(layer, Gemma3DecoderLayer):
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    norms += [n for n in (attn.q_norm, attn.k_norm) if n is not None]
    fits = (
        len(linears) == len(_PROJECTIONS)
        and mlp.activation in kernels.GATED_ACTIVATIONS
        and len({(n.unit_offset, n.eps) for n in norms}) == 1
        and all(n.weight.dtype == torch.float32 for n in norms)
        and attn.head_dim % 8 == 0 and attn.head_dim <= 256
    )
    return StackLayer(layer, mlp, linears) if fits else None


def _shape(c: StackLayer) -> tuple[object, ...]:
    """What one DecodeShape holds for every layer."""
    attn, norm = c.layer.self_attn, c.layer.input_layernorm
    return (*(m.out_features for m in c.linears), attn.num_heads, attn.num_kv_heads, attn.head_dim,
            norm.unit_offset, norm.eps, c.mlp.activation, attn.q_scale)
