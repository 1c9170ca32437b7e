"""A model tokenmill reads as a plain Hugging Face folder, for engines that cannot read GGUF.

vLLM's CPU build does not load GGUF files. The folder written here holds the weights our own
GGUF reader gives (dequantised, fp32, Hugging Face names), the config transformers would write
for them and the file's tokenizer, so the embedded engine and another engine loading the folder
run the very same weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tokenmill.environment import NAMED_MODELS, cache_root
from tokenmill.models.gguf_file import read_gguf
from tokenmill.models.loader import file_key, load_tokenizer, looks_like_hub_id, model_path


def hf_folder_for(model: str | None) -> str:
    """`model` as a Hugging Face folder or hub id: a folder or hub id is returned as it is; a GGUF
    file (or the embedded default, or a named model) is exported once into the cache."""
    if model is not None and model not in NAMED_MODELS:
        path = Path(model).expanduser()
        if path.is_dir() or (not path.exists() and looks_like_hub_id(model)):
            return model
    path = model_path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"model {model!r} not found: give a .gguf file, a folder or a hub id")
    folder = cache_root() / "hf-export" / f"{path.stem}-{file_key(path)}"
    if not (folder / "config.json").is_file():
        export_gguf(path, folder)
    return str(folder)


def export_gguf(path: Path, folder: Path) -> None:
    """Write the GGUF file at `path` as a Hugging Face folder; config.json goes last, so a folder
    that has one is complete."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg, state_dict = read_gguf(path)
    if cfg.pop("rope_freq_factors", None) is not None:
        raise ValueError(f"{path}: its rope_freqs (Llama 3.1+ RoPE scaling as llama.cpp stores it) have no "
                         "Hugging Face config field; use the model's Hugging Face checkpoint instead")
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if v is not None})
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in state_dict.items() if isinstance(t, torch.Tensor)}
    assert len(tensors) == len(state_dict), "read_gguf's default keeps no block quantised"
    save_file(tensors, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer = load_tokenizer(str(path))
    if tokenizer is None:
        raise ValueError(f"{path}: no tokenizer could be built from the file")
    tokenizer.save_pretrained(str(folder))
    partial = folder / "config.json.partial"
    config.to_json_file(str(partial))
    os.replace(partial, folder / "config.json")
