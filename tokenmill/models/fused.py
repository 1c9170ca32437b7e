"""decoder.py's modules with the C kernels (csrc/, built by kernels.py) behind some of their steps,
for a model on a CPU in float32 where the kernels build: build.py then builds FusedCausalLM
instead of CausalLM. Each kernel computes what the step it replaces does, in one pass where torch
makes several ops or copies:
- FusedRMSNorm: csrc/rms_norm.c, one pass per row (torch's CPU rms_norm runs five ops);
- FusedAttention: RoPE in place (csrc/activations.c), and attention read straight from the paged
  cache for the groups the runner left without a mask (paged_attention.py);
- FusedMLP: the gate, act(gate) · up, in one pass over the fused projection's output;
- FusedCausalLM: a decode step's layers in one C call, where they fit (decode_stack.py).
The device and dtype are the model's, settled when it is built; what each call's tensors look like
(their strides) is checked at the call, and the PyTorch step runs where the kernel could not.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models import kernels
from tokenmill.models.attention_metadata import AttentionGroup, AttentionMetadata
from tokenmill.models.config import ModelConfig
from tokenmill.models.decode_stack import DecodeStack
from tokenmill.models.decoder import MLP, Attention, CausalLM, RMSNorm
from tokenmill.models.paged_attention import paged_decode_attention, paged_prefill_attention


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """csrc/rms_norm.c: one pass per row, where torch's CPU rms_norm runs five ops."""
    lib = kernels.library()
    assert lib is not None
    x = x.contiguous()
    y = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], eps, offset,
                 torch.get_num_threads())
    return y


def gated_activation_kernel(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """csrc/activations.c: act(gate) · up from the fused projection's output, in one pass."""
    lib = kernels.library()
    assert lib is not None
    rows, width = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], width)
    lib.gated_activation(gate_up.data_ptr(), out.data_ptr(), rows, width, kernels.GATED_ACTIVATIONS[activation],
                         torch.get_num_threads())
    return out


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_kernel(x, self.weight, self.eps, 1.0 if self.unit_offset else 0.0)


class FusedAttention(Attention):
    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place where x's heads are dense (its rows may be strided: a view of the fused qkv
        output)."""
        tokens, heads, head_dim = x.shape
        if not (x.stride(2) == 1 and x.stride(1) == head_dim and cos.is_contiguous()):
            return super().rotate(x, cos, sin)
        lib = kernels.library()
        assert lib is not None
        sin = sin.contiguous()
        lib.rope_inplace(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, head_dim, cos.shape[-1],
                         x.stride(0), torch.get_num_threads())
        return x

    def attend_into(
        self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup
    ) -> None:
        if g.mask is None and g.query_index.shape[1] > 1:  # prompt spans, for the prefill kernel
            paged_prefill_attention(q, out, k_cache, v_cache, g.query_index[:, 0], g.num_new, g.context_lens,
                                    g.context_blocks, self.sliding_window)
        else:
            super().attend_into(out, q, k_cache, v_cache, g)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if g.mask is None:  # decodes, straight from the paged cache
            rows = q if g.covers_batch else q[g.output_rows]
            return paged_decode_attention(rows, k_cache, v_cache, g.context_blocks, g.context_lens,
                                          self.sliding_window)
        return super().attend(q, k_cache, v_cache, g)


class FusedMLP(MLP):
    def gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous():  # the kernel reads whole rows
            return super().gated(gate_up)
        return gated_activation_kernel(gate_up, self.activation)


def _fused(module: nn.Module, cfg: ModelConfig) -> nn.Module | None:
    """The kernel-backed module built as `module` was (its weights are loaded afterwards), or None
    where it has none."""
    if isinstance(module, RMSNorm):
        return FusedRMSNorm(module.weight.shape[0], module.eps, module.unit_offset)
    if isinstance(module, Attention):
        return FusedAttention(cfg, module.sliding_window)
    # The kernel takes each half of a row eight floats at a time.
    if isinstance(module, MLP) and module.gate_up_proj.out_features % 16 == 0:
        return FusedMLP(cfg)
    return None


def _swap_in_fused(parent: nn.Module, cfg: ModelConfig) -> None:
    for name, child in list(parent.named_children()):
        fused = _fused(child, cfg)
        if fused is not None:
            setattr(parent, name, fused)
            child = fused
        _swap_in_fused(child, cfg)  # a fused module's children too: Attention's q/k norms


class FusedCausalLM(CausalLM):
    """CausalLM with decoder.py's modules swapped for the fused ones, before the weights load.
    (Its modules are made twice: under torch.device("meta"), as build.py makes it, at no cost.)"""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        _swap_in_fused(self, cfg)
        # Decode steps run every layer in one C call where the layers allow (decode_stack.py);
        # False keeps the layer-by-layer path (the tests compare the two).
        self.use_decode_stack = True
        self._decode_stack: DecodeStack | None = None
        self._decode_stack_built = False

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        super()._apply(fn, recurse)
        self._decode_stack_built = False  # the stack holds the buffers' addresses: built again
        return self

    def decode_stack(self, meta: AttentionMetadata) -> DecodeStack | None:
        """The C stack when this step is decodes only, attended by the paged kernel."""
        g = meta.groups[0]
        if not (self.use_decode_stack and len(meta.groups) == 1 and g.covers_batch and g.mask is None):
            return None
        if not self._decode_stack_built:
            self._decode_stack = DecodeStack.build(list(self.model.layers), self.rope_cos.shape[-1])
            self._decode_stack_built = True
        return self._decode_stack

    def run_layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        stack = self.decode_stack(meta)
        if stack is None:
            return super().run_layers(x, rope, local_rope, kv_caches, meta)
        g = meta.groups[0]
        return stack(x.contiguous(), rope, local_rope, kv_caches, meta.slot_mapping, g.context_blocks, g.context_lens)
