"""Linear layers with weights laid out once, at load time, for the CPU kernels that use them.

Two layouts, chosen per call by the number of rows (tokens in the step):
- oneDNN's packed layout for GEMMs. A plain fp32 `F.linear` on CPU re-packs the weight on every
  call; packing once (what torch's inductor does for frozen CPU graphs) measured 1.7x faster at
  prefill size and 2-2.5x at decode batch sizes on the 2-core development machine.
- Eight output columns interleaved, for csrc/small_gemm.c, at up to SMALL_BATCH_ROWS rows: there
  the layer is a matrix-vector product bound by memory bandwidth, and oneDNN reached about half
  of it (`python benchmarks/small_gemm.py` measures both).
Keeping both costs a second copy of the linear weights, so whether to keep the second is an
engine setting (EngineConfig.small_batch_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models import kernels

# Up to this many rows the small-batch kernel clearly beat oneDNN over all SmolLM2 layers here
# (1.6-1.7x at 1-8 rows, 1.3-1.4x at 16, within noise of 1.1x at 24-48, behind at 64);
# benchmarks/small_gemm.py prints the comparison.
SMALL_BATCH_ROWS = 16


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def blocked_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/8, K, 8]: the layout csrc/small_gemm.c streams."""
    n, k = weight.shape
    return weight.reshape(n // 8, 8, k).transpose(1, 2).contiguous()


def small_gemm(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias), W given as blocked_weight(W); fp32 on CPU."""
    lib = kernels.library()
    assert lib is not None, "the CPU kernels did not build"
    x = x.contiguous()
    blocks, k, _ = blocked.shape
    out = torch.empty(x.shape[0], blocks * 8, dtype=x.dtype)
    status = lib.small_gemm(
        x.data_ptr(), blocked.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        x.shape[0], blocks * 8, k, torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"small_gemm: out_features {blocks * 8} must be a multiple of 8, in_features {k} of 4")
    return out


class PackedLinear(nn.Module):
    weight: torch.Tensor  # oneDNN-packed, or plain [N, K]
    blocked: torch.Tensor | None  # blocked_weight(), or None: no small-batch kernel

    def __init__(self, linear: nn.Linear, batch_hint: int, onednn: bool = True, small_batch: bool = False) -> None:
        """`onednn`: pack for oneDNN GEMMs (else plain F.linear); `small_batch`: also keep the
        layout of the small-batch kernel, when the shape allows it."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.onednn = onednn
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if onednn else weight
        self.register_buffer("weight", packed)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()
        fits = self.out_features % 8 == 0 and self.in_features % 4 == 0 and weight.dtype == torch.float32
        self.register_buffer("blocked", blocked_weight(weight) if small_batch and fits else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked is not None and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS:
            return small_gemm(x, self.blocked, self.bias)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, batch_hint: int, onednn: bool = True, small_batch: bool = False) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear; returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, batch_hint, onednn, small_batch))
                replaced += 1
    return replaced
