"""A decode step's decoder layers in one C call (csrc/decode_layers.c), for the models it covers.

The layer-by-layer forward makes ~17 Python calls per layer; at batch 1 their overhead cost more
than the matmuls. The C stack runs the same kernel bodies in the same order (bitwise the same
result), so CausalLM takes it for every step of decodes only, where it applies: Llama-shaped layers
(no per-head q/k norm, no MoE, SiLU MLP, no query rescaling, one RoPE table) whose linear layers
are all quantised, on a CPU where the kernels build.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

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
            args.input_norm = layer.input_layernorm.weight.data_ptr()
            args.post_attention_norm = layer.post_attention_layernorm.weight.data_ptr()
            for name, linear in zip(_PROJECTIONS, _linears(layer), strict=True):
                setattr(args, name, linear.kernel_args())
            args.window = layer.self_attn.sliding_window or 0
        self._shape = kernels.DecodeShape(
            num_layers=len(layers), hidden=layers[0].input_layernorm.weight.shape[0], heads=first.num_heads,
            kv_heads=first.num_kv_heads, head_dim=first.head_dim, rotary=rotary_dim,
            intermediate=layers[0].mlp.down_proj.in_features, eps=layers[0].input_layernorm.eps,
            attention_scale=first.head_dim**-0.5,
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
        cos: torch.Tensor,  # [S, rotary]
        sin: torch.Tensor,
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
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        self._shape.max_blocks = tables.shape[1]
        status = lib.decode_layers(
            self._args, ctypes.byref(self._shape), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"decode_layers failed ({status}): a context empty or longer than its "
                               "block table, or out of memory")
        return x


def _linears(layer: Layer) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)


def _shape(layer: Layer) -> tuple[int, ...]:
    attn = layer.self_attn
    return (*(m.out_features for m in _linears(layer)), attn.num_heads, attn.num_kv_heads, attn.head_dim)


def _covered(layer: Layer) -> bool:
    attn, norms = layer.self_attn, (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        all(isinstance(linear, QuantizedLinear) for linear in _linears(layer))
        and getattr(layer.mlp, "act", None) is F.silu
        and not hasattr(layer, "pre_feedforward_layernorm")  # Gemma 3's four norms
        and attn.q_norm is None and attn.q_scale == 1.0 and not layer.local_rope
        and all(not n.unit_offset and n.weight.dtype == torch.float32 for n in norms)
        and attn.head_dim % 8 == 0 and attn.head_dim <= 256
    )
