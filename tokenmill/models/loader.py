"""Find and load a model: a GGUF file, a Hugging Face folder, or a hub id.

The tokenizer (and its chat template) always comes from the same source as the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.environment import cache_root, embedded_model_path
from tokenmill.models.config import ModelConfig
from tokenmill.models.gguf_file import read_gguf

log = logging.getLogger(__name__)


@dataclass
class LoadedWeights:
    source: str  # the resolved file or folder
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any  # a transformers tokenizer, or None when the source has none


def load_weights(model: str | None, tokenizer: str | None = None) -> LoadedWeights:
    path = embedded_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, tokenizer)
    if path.is_dir():
        return _load_folder(path, tokenizer)
    if path.exists():
        raise ValueError(f"model {model!r} is neither a .gguf file nor a model folder")
    if model is not None and _looks_like_hub_id(model):
        return _load_folder(_download_from_hub(model), tokenizer)
    raise FileNotFoundError(f"model {model!r} not found: give a .gguf file, a folder or a hub id")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as exc:  # offline, unknown repo, gated...
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched from the hub: {exc}"
        ) from exc


def _load_folder(folder: Path, tokenizer: str | None) -> LoadedWeights:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    cfg = json.loads(config_file.read_text())
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        # generation_config.json often lists more EOS ids than config.json (e.g. Llama 3).
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        cfg["eos_token_id"] = gen_eos if gen_eos is not None else cfg.get("eos_token_id")
    config = ModelConfig.from_hf(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    from safetensors.torch import load_file

    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file)))
    return LoadedWeights(str(folder), config, state_dict, _load_tokenizer(tokenizer or str(folder)))


def load_tokenizer(source: str | None) -> Any:
    """A tokenizer on its own: from a .gguf file (None: the embedded model's), a Hugging Face
    folder or a hub id; None (with a warning) when there is none."""
    if source is None or source.endswith(".gguf"):
        return _cached_gguf_tokenizer(Path(source) if source else embedded_model_path())
    return _load_tokenizer(source)


def _load_tokenizer(source: str, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer loaded from %s (%s): only token-id prompts will work", source, exc)
        return None


def _load_gguf(path: Path, tokenizer: str | None) -> LoadedWeights:
    cfg, state_dict = read_gguf(path)
    tok = _load_tokenizer(tokenizer) if tokenizer else _cached_gguf_tokenizer(path)
    return LoadedWeights(str(path), ModelConfig.from_hf(cfg), state_dict, tok)


def _cached_gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary to a fast tokenizer takes ~10 s; do it once per file."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    cache = cache_root() / "tokenizers" / key[:16]
    if (cache / "tokenizer_config.json").is_file():
        tok = _load_tokenizer(str(cache))
        if tok is not None:
            return tok
    tok = _load_tokenizer(str(path.parent), gguf_file=path.name)
    if tok is not None:
        try:
            tok.save_pretrained(str(cache))
        except OSError as exc:  # a read-only home is no reason to fail
            log.warning("could not cache the tokenizer in %s: %s", cache, exc)
    return tok
