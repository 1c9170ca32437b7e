"""A mixture-of-experts feed-forward block (Mixtral, Qwen2-MoE, Qwen3-MoE) on a flat token batch.

Each token's router picks its top-k experts. Rather than running the picked experts token by
token, the step's (token, expert) pairs are sorted by expert, so each expert that was picked at
all runs one GEMM over all of its tokens: on a CPU the cost is then E GEMMs per step whatever
the batch, and weights are read once per step. Qwen2-MoE adds a shared expert every token goes
through, scaled by a sigmoid gate.

Checkpoints keep one tensor per expert (`experts.N.w1` in Mixtral, `experts.N.gate_proj` in
Qwen); `stack_experts` stacks them into [E, 2I, H] and [E, H, I] at load.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """SiLU(gate) * up, then down, with gate and up in one GEMM."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool,
        shared_intermediate: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = Experts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        weights, picked = self._route(x)
        flat = picked.flatten()  # [T * k]: the expert of each (token, slot)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        scale = weights.flatten()[order, None]
        tokens = order // self.top_k
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            gate, up = F.linear(x[tokens[rows]], self.experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[expert])
            out.index_add_(0, tokens[rows], y * scale[rows])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, experts [T, k]): softmax over all experts in fp32, the top k,
        renormalised to sum to 1 where the model asks for it (Mixtral always does)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, picked = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), picked


def is_moe_layer(layer: int, num_experts: int, decoder_sparse_step: int = 1,
                 mlp_only_layers: list[int] | tuple[int, ...] = ()) -> bool:
    """Qwen-MoE's rule (Mixtral: every layer): not listed as dense, and every `step`-th layer."""
    return num_experts > 0 and layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0


# Per-expert checkpoint names: (prefix, expert, part) → gate / up / down.
_EXPERT = re.compile(r"(.*\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def stack_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → this module's: experts stacked, Mixtral's `block_sparse_moe` as `mlp`,
    the shared expert's gate and up fused. Other tensors pass through."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        match = _EXPERT.fullmatch(name)
        if match:
            prefix, index, part = match.groups()
            experts.setdefault(prefix, {}).setdefault(_PARTS[part], {})[int(index)] = tensor
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for prefix, parts in experts.items():
        n = len(parts["gate"])
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    for name in [n for n in out if n.endswith(".mlp.shared_expert.gate_proj.weight")]:
        base = name.removesuffix("gate_proj.weight")
        out[f"{base}gate_up_proj.weight"] = torch.cat([out.pop(name), out.pop(f"{base}up_proj.weight")])
    return out
