"""A decode step's decoder layers in one C call (csrc/decode_layers.c), for the models it covers.

The layer-by-layer forward makes ~17 Python calls per layer (Gemma 3's, ~25); at batch 1 their
overhead cost more than the matmuls. The C stack runs the same kernel bodies in the same order
(bitwise the same result), so CausalLM takes it for every step of decodes only, where it applies:
dense layers (no MoE) with a SiLU or tanh-GELU gate whose linear layers are all quantised, on a
CPU where the kernels build. Llama, Mistral, Qwen2, Phi-3, Qwen3 (per-head q/k norms) and Gemma 3
(four norms scaling by 1 + w, a query scalar, a local RoPE table on sliding layers) fit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from tokenmill.models import kernels
from tokenmill.models.quant import QuantizedLinear, kernel_available

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# A layer is decoder.py's DecoderLayer, read by attribute (that module imports this one).
Layer = Any


class DecodeStack:
    def __init__(self, layers: Sequence[Layer], rotary_dim: int) -> None:
        first = layers[0].self_attn
        self._args = (kernels.DecodeLayer * len(layers))()
        for args, layer in zip(self._args, layers, strict=True):
            attn = layer.self_attn
            args.input_norm = layer.input_layernorm.weight.data_ptr()
            args.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            args.q_norm, args.k_norm = (None, None) if attn.q_norm is None else \
                (attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr())
            if hasattr(layer, "post_feedforward_layernorm"):  # Gemma 3's sandwich
                args.ffn_norm = layer.pre_feedforward_layernorm.weight.data_ptr()
                args.post_ffn_norm = layer.post_feedforward_layernorm.weight.data_ptr()
            for name, linear in zip(_PROJECTIONS, _linears(layer), strict=True):
                setattr(args, name, linear.kernel_args())
            args.window = attn.sliding_window or 0
            args.local_rope = int(layer.local_rope)
        self._shape = kernels.DecodeShape(
            num_layers=len(layers), hidden=layers[0].input_layernorm.weight.shape[0], heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=first.head_dim, rotary=rotary_dim,
            intermediate=layers[0].mlp.down_proj.in_features, eps=layers[0].input_layernorm.eps,
            attention_scale=first.head_dim**-0.5, norm_offset=float(layers[0].input_layernorm.unit_offset),
            activation=kernels.GATED_ACTIVATIONS[layers[0].mlp.activation], q_scale=first.q_scale,
        )
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def build(cls, layers: Sequence[Layer], rotary_dim: int) -> DecodeStack | None:
        """The stack for these layers, or None where the C kernel does not cover them."""
        covered = kernel_available() and all(map(_covered, layers))
        # One DecodeShape serves every layer.
        return cls(layers, rotary_dim) if covered and len({_shape(layer) for layer in layers}) == 1 else None

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


def _linears(layer: Layer) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)


def _shape(layer: Layer) -> tuple[Any, ...]:
    """What one DecodeShape holds for every layer."""
    attn = layer.self_attn
    return (*(m.out_features for m in _linears(layer)), attn.num_heads, attn.num_kv_heads, attn.head_dim,
            layer.input_layernorm.unit_offset, layer.input_layernorm.eps, getattr(layer.mlp, "activation", None),
            attn.q_scale)


def _norms(layer: Layer) -> list[Any]:
    attn = layer.self_attn
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return [getattr(layer, n) for n in names if hasattr(layer, n)] + [n for n in (attn.q_norm, attn.k_norm) if n]


def _covered(layer: Layer) -> bool:
    attn, norms = layer.self_attn, _norms(layer)
    return (
        all(isinstance(linear, QuantizedLinear) for linear in _linears(layer))
        and getattr(layer.mlp, "activation", None) in kernels.GATED_ACTIVATIONS
        and len({(n.unit_offset, n.eps) for n in norms}) == 1
        and all(n.weight.dtype == torch.float32 for n in norms)
        and attn.head_dim % 8 == 0 and attn.head_dim <= 256
    )
