"""What the runner builds for each step and the model reads to attend over the paged KV cache.

ModelRunner (engine/model_runner.py) turns a scheduled batch into an AttentionMetadata: the cache
slot of every new token's K/V (slot_mapping) and the requests grouped to be attended together
(AttentionGroup: which rows of the flat token batch are each request's queries, its block table and
context length, and the causal / sliding-window mask, or none where a C kernel attends them).
CausalLM (decoder.py) writes K/V to those slots, attends each group over its gathered context, and
adds to each group, per step, its mask narrowed to the layer windows the mask does not carry
(narrow_to_window: Gemma 3's sliding layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionGroup:
    """Requests attended together: queries padded to [G, Lq], context padded to [G, Lk]."""

    query_index: torch.Tensor  # [G, Lq] rows of the flat token batch (padding: any row)
    query_valid: torch.Tensor  # [G, Lq] bool
    context_blocks: torch.Tensor  # [G, NB] block tables (padding: the zeroed null block)
    context_lens: torch.Tensor  # [G] keys at positions < len are context
    # [G, 1, group*Lq, NB*block_size] bool, repeated for the query-head group: causal, within
    # the context and ModelConfig.sliding_window. None when a C kernel attends the group (decodes,
    # or prompt spans), reading context_lens and num_new instead.
    mask: torch.Tensor | None
    output_rows: torch.Tensor  # query_index[query_valid]
    num_new: torch.Tensor  # [G] each request's queries (valid entries of its query_index row)
    covers_batch: bool = False  # the group is every row of the batch, in order (pure decode)
    # `mask` narrowed to each layer window it does not carry (Gemma 3's sliding layers), keyed by
    # window; filled by CausalLM.forward (decoder.py).
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """One step's attention inputs: where each new token's K/V goes, and the request groups."""

    slot_mapping: torch.Tensor  # [T] slot (block * block_size + offset) of each new token's K/V
    groups: list[AttentionGroup]


def narrow_to_window(g: AttentionGroup, window: int, query_group: int) -> torch.Tensor:
    """g.mask keeping only the keys less than `window` positions behind their query
    (transformers' `k > q - window`); padded query rows stay as they were (no all-False rows)."""
    assert g.mask is not None
    lq = g.query_valid.shape[1]
    device = g.query_valid.device
    q_pos = (g.context_lens - g.query_valid.sum(1))[:, None] + torch.arange(lq, device=device)
    k_pos = torch.arange(g.mask.shape[-1], device=device)
    in_window = (k_pos[None, None, :] > q_pos[:, :, None] - window) | ~g.query_valid[:, :, None]
    return g.mask & in_window.repeat(1, query_group, 1)[:, None]  # rows ordered (head in group, query)
