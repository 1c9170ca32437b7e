"""Loaded weights → a model ready to run on a device (the C kernels behind its modules where they run,
projections fused, RoPE tables made, linear layers packed for the CPU kernels), and how much memory
is left there to size caches with."""

from __future__ import annotations

import os

import torch

from tokenmill.models import kernels
from tokenmill.models.decoder import CausalLM, fuse_projections
from tokenmill.models.fused import FusedCausalLM
from tokenmill.models.huge_pages import move_to_huge_pages
from tokenmill.models.loader import LoadedWeights
from tokenmill.models.moe import stack_experts
from tokenmill.models.packed import onednn_packing_available, pack_linears
from tokenmill.models.quant import (
    Quantized,
    QuantizedEmbedding,
    QuantizedParts,
    Weight,
    fits_kernel,
    install_quantized,
    quantize_linear_weights,
)


def build_model(
    weights: LoadedWeights,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    pack_weights: bool = True,
    batch_hint: int = 2048,
    small_batch_kernel: bool = False,
    weight_format: str = "fp32",
    head: bool = True,
) -> CausalLM:
    """The C kernels run where they can (fused.py), chosen here, once, by device and dtype.
    `batch_hint`: the most tokens one forward will see (oneDNN packs for it);
    `small_batch_kernel`: also keep the weights in the small-batch kernel's layout;
    `weight_format` (models/quant.py WEIGHT_FORMATS): which fp32 linear weights to quantise (the
    loader already kept a GGUF's quantised ones as they are); `head=False`: no output layer (an
    embedding model reads `hidden_states`, and its checkpoint may have none)."""
    with torch.device("meta"):
        model = FusedCausalLM(weights.config) if kernels.supports(device, dtype) else CausalLM(weights.config)
    if not head:
        model.lm_head = torch.nn.Identity()
    skipped = ("rotary_emb",) if head else ("rotary_emb", "lm_head.")
    source = {k: v for k, v in language_model_weights(weights).items() if not any(s in k for s in skipped)}
    tensors = {k: v.to(dtype) for k, v in source.items() if isinstance(v, torch.Tensor)}
    blocks = {k: v for k, v in source.items() if isinstance(v, Quantized)}  # a GGUF's: never MoE experts
    state = quantize_linear_weights(fuse_projections({**stack_experts(tensors), **blocks}), weight_format)
    quantized = _split_quantized(state)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    install_quantized(model, quantized)
    missing = [k for k in missing if k not in quantized]
    if weights.config.tie_word_embeddings and head:
        embed = model.model.embed_tokens
        if isinstance(embed, QuantizedEmbedding):
            model.lm_head = embed.table
        else:
            model.lm_head.weight = embed.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{weights.source}: weights do not match the {weights.config.model_type} architecture "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.init_rope(max_positions)
    model = model.to(device).eval()
    onednn = pack_weights and onednn_packing_available(device, dtype)
    if onednn or small_batch_kernel:
        pack_linears(model, batch_hint, onednn=onednn, small_batch=small_batch_kernel)
    if device.type == "cpu":  # a decode step streams the weights: 2 MiB pages read faster
        move_to_huge_pages(model)
    return model


def _split_quantized(state: dict[str, Weight]) -> dict[str, Quantized | QuantizedParts]:
    """Take the quantised weights out of `state` (what load_state_dict cannot take); one whose
    shape (or a part's) the kernel cannot run goes back in as fp32."""
    quantized: dict[str, Quantized | QuantizedParts] = {}
    for name, value in list(state.items()):
        if isinstance(value, Quantized | QuantizedParts):
            parts = value.parts if isinstance(value, QuantizedParts) else (value,)
            if all(fits_kernel(*part.shape) for part in parts):
                quantized[name] = value
                del state[name]
            else:
                state[name] = value.dequantize()
    return quantized


# Gemma 3's multimodal checkpoints hold the text model under another prefix (transformers 4.5x
# wrote language_model.model.*, 5.x writes model.language_model.*) beside a vision tower.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model_weights(weights: LoadedWeights) -> dict[str, Weight]:
    """The text model's weights under the names CausalLM uses: a multimodal Gemma 3 checkpoint
    runs text-only."""
    if weights.config.model_type != "gemma3_text":
        return weights.state_dict
    state = {}
    for name, tensor in weights.state_dict.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        state[name if prefix is None else _TEXT_PREFIXES[prefix] + name[len(prefix) :]] = tensor
    return state


def weight_bytes(weights: LoadedWeights, dtype: torch.dtype) -> int:
    """The model's fp32/bf16 weights held in `dtype` (what one more copy of them costs)."""
    tensors = [t for t in language_model_weights(weights).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() for t in tensors) * dtype.itemsize


def free_memory(device: torch.device) -> int:
    """Bytes free on the device now: the GPU's free memory, or the machine's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
