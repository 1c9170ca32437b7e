"""Linear layers with weights pre-packed for oneDNN, for CPU inference.

A plain fp32 `F.linear` on CPU re-packs the weight matrix on every call, which dominates at the
small row counts of decode steps. Packing once at load time (what torch's inductor does for
frozen CPU graphs) measured 1.7x faster at prefill size and 2-2.5x at decode batch sizes on the
2-core development machine (benchmarks/engine_vs_hf.py measures the whole engine).
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, batch_hint))
                replaced += 1
    return replaced
