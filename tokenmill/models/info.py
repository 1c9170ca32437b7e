"""What a model file or folder is, read from its headers only: a GGUF file's metadata and tensor
infos, or a Hugging Face folder's config.json and safetensors JSON headers. No weight is read,
dequantised or downloaded and no tokenizer is built, so a large model costs what a small one does.

Whether tokenmill runs it is decided by the loader's own checks (called here, their ValueError
being the reason), never by a second copy of its rules.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.formats.gguf_config import ROPE_FREQS, gguf_config
from tokenmill.formats.gguf_header import GGUFHeader, read_gguf_header
from tokenmill.formats.safetensors_header import safetensors_header
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf_file import hf_tensor_name, refuse_unrunnable
from tokenmill.models.loader import check_folder, looks_like_hub_id, model_path, read_config, weight_files
from tokenmill.models.quant import held_as

# The KV cache dtypes whose size per token is reported.
KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2}


@dataclass
class ModelInfo:
    source: str  # the resolved file or folder
    name: str
    format: str  # "GGUF v3" or "safetensors"
    tensor_types: dict[str, int]  # GGML type / safetensors dtype -> how many tensors, most first
    family: str | None  # the GGUF architecture, or config.json's model_type
    model_type: str | None  # transformers' name for the family (a GGUF architecture may differ)
    architecture: str | None  # the transformers class(es), where known
    parameters: int  # from the tensor shapes in the file(s), a shared tensor counted once
    tied_embeddings: bool  # lm_head is the embedding matrix, not a tensor of its own
    weight_bytes: int  # stored size of the tensors
    runs: bool
    reason: str | None  # why tokenmill would not load it: the loader's own words
    # The architecture, read with the loader's ModelConfig; None where the config cannot be read.
    context_length: int | None = None
    layers: int | None = None
    hidden_size: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    kv_bytes_per_token: dict[str, int] = field(default_factory=dict)  # per KV_DTYPE_BYTES dtype
    # GGUF: how the loader keeps the tensors under --weight-format auto (quant.held_as) -> how many.
    held_as: dict[str, int] = field(default_factory=dict)
    sliding_window: int | None = None
    sliding_window_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0


def describe(model: str | None) -> ModelInfo:
    """`model` as --model takes it: None (the embedded SmolLM2), a named model, a .gguf file, a
    Hugging Face folder, or a hub id already in the Hugging Face cache (nothing is downloaded)."""
    path = model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _describe_gguf(read_gguf_header(path))
    if path.is_dir():
        return _describe_folder(path)
    if path.exists():
        raise ValueError(f"model {model!r} is neither a .gguf file nor a model folder")
    if model is not None and looks_like_hub_id(model):
        return _describe_folder(_cached_hub_folder(model))
    raise FileNotFoundError(f"model {model!r} not found: give a .gguf file, a folder or a hub id")


def _describe_gguf(header: GGUFHeader) -> ModelInfo:
    def loads() -> None:  # read_gguf's checks, then the config the loader builds from the file
        refuse_unrunnable(header)
        ModelConfig.from_hf(gguf_config(header))

    tensors = header.tensors.values()
    cfg = _or_none(lambda: gguf_config(header))
    model_type = cfg.get("model_type") if cfg else None
    return _info(
        config=_model_config(cfg) if cfg else None,
        source=str(header.path),
        name=str(header.metadata.get("general.name") or header.path.stem),
        format=f"GGUF v{header.version}",
        tensor_types=_most_first(t.type_name for t in tensors),
        family=header.metadata.get("general.architecture"),
        model_type=model_type,
        architecture=_transformers_class(model_type),
        parameters=sum(t.n_elements for t in tensors),
        tied_embeddings="output.weight" not in header.tensors,  # llama.cpp's name for lm_head
        weight_bytes=sum(t.n_bytes for t in tensors),
        reason=_refusal(loads),
        held_as=_held_as(header),
    )


def _held_as(header: GGUFHeader) -> dict[str, int]:
    arch = str(header.metadata.get("general.architecture"))
    try:
        names = {name: hf_tensor_name(name, arch) for name in header.tensors if name != ROPE_FREQS}
    except ValueError:  # a tensor the loader has no name for: the file does not run (see reason)
        return {}
    # A fused projection's parts each keep their own format (quant.concatenate).
    kept = {name: held_as("auto", names[name], info.type_name, info.shape)
            for name, info in header.tensors.items() if name in names}
    return _most_first(kept.values())


def _describe_folder(folder: Path) -> ModelInfo:
    def loads() -> None:  # _load_folder's checks, then its config
        cfg, _ = check_folder(folder)
        ModelConfig.from_hf(cfg)

    cfg = read_config(folder)
    entries = {name: entry for file in weight_files(folder) for name, entry in safetensors_header(file).items()}
    config = _model_config(cfg)
    # Tied: the loader points lm_head at the embedding, so a stored lm_head copy is not a parameter.
    lm_heads = {name for name in entries if name.endswith("lm_head.weight")}
    tied = not lm_heads or (config.tie_word_embeddings if config else bool(cfg.get("tie_word_embeddings")))
    counted = {name: entry for name, entry in entries.items() if not (tied and name in lm_heads)}
    model_type = cfg.get("model_type")
    return _info(
        config=config,
        source=str(folder),
        name=str(cfg.get("_name_or_path") or folder.name),
        format="safetensors",
        tensor_types=_most_first(entry["dtype"] for entry in counted.values()),
        family=model_type,
        model_type=model_type,
        architecture=", ".join(cfg.get("architectures") or []) or _transformers_class(model_type),
        parameters=sum(math.prod(entry["shape"]) for entry in counted.values()),
        tied_embeddings=tied,
        weight_bytes=sum(end - start for start, end in (entry["data_offsets"] for entry in counted.values())),
        reason=_refusal(loads),
    )


def _info(config: ModelConfig | None, reason: str | None, **facts: Any) -> ModelInfo:
    """The file's facts plus what its config says about the architecture."""
    info = ModelInfo(**facts, runs=reason is None, reason=reason)
    if config is None:
        return info
    windows = [config.layer_window(layer) for layer in range(config.num_hidden_layers)]
    sliding = [w for w in windows if w is not None]
    info.context_length = config.max_position_embeddings
    info.layers, info.hidden_size, info.vocab_size = config.num_hidden_layers, config.hidden_size, config.vocab_size
    info.heads, info.kv_heads, info.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                config.head_dim)
    info.kv_bytes_per_token = {name: config.kv_bytes_per_token(size) for name, size in KV_DTYPE_BYTES.items()}
    info.sliding_window, info.sliding_window_layers = max(sliding, default=None), len(sliding)
    info.experts, info.experts_per_token = config.num_experts, config.num_experts_per_tok
    return info


def _model_config(cfg: dict[str, Any]) -> ModelConfig | None:
    """The loader's ModelConfig of the config; for a family tokenmill does not run, the same read
    under Llama's rules (every transformers decoder config names its sizes alike), so its size is
    still reported; None where even that fails."""
    for attempt in (cfg, {**cfg, "model_type": "llama"}):
        try:
            return ModelConfig.from_hf(attempt)
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _refusal(loads: Callable[[], None]) -> str | None:
    try:
        loads()
    except ValueError as exc:
        return str(exc)
    return None


def _or_none(read: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """A GGUF architecture the reader does not know may lack keys it expects."""
    try:
        return read()
    except (ValueError, KeyError, TypeError):
        return None


def _most_first(names: Iterable[str]) -> dict[str, int]:
    return dict(Counter(names).most_common())


def _transformers_class(model_type: str | None) -> str | None:
    """The transformers class that generates text for a model_type (GGUF files do not say)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if model_type else None


def _cached_hub_folder(repo_id: str) -> Path:
    """A hub id's snapshot in the local Hugging Face cache (`tokenmill run` puts it there); info
    reads no network."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # not cached (huggingface_hub's own error types vary by version)
        raise FileNotFoundError(f"model {repo_id!r} is not a local file or folder and not in the Hugging Face "
                                f"cache; `tokenmill info` reads no network: download it first "
                                f"(`hf download {repo_id}`)") from exc
