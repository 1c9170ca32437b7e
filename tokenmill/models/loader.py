"""Find and load a model: a GGUF file, a Hugging Face folder, or a hub id.

The tokenizer (and its chat template) always comes from the same source as the weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.environment import NAMED_MODELS, cache_root, embedded_model_path, named_model_path
from tokenmill.formats.safetensors_header import safetensors_header
from tokenmill.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tokenmill.models.gguf_file import read_gguf
from tokenmill.models.quant import Quantized, Weight

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
# Config, generation config, shard index, tokenizer and chat template: what the weights need beside them.
_HUB_METADATA = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# Mistral's own format (original/, consolidated*, params.json) duplicates the HF weights; never read here.
_HUB_IGNORE = ["original/*", "consolidated*", "params.json"]
_GENERATING_HEADS = ("ForCausalLM", "ForConditionalGeneration")
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_LOW_PRECISION_DTYPES = {"F8_E4M3": "FP8", "F8_E5M2": "FP8", "F8_E8M0": "FP8", "F6_E2M3": "FP6",
                         "F6_E3M2": "FP6", "F4": "FP4"}
_RUNS = "tokenmill runs fp32/bf16/fp16 safetensors and GGUF files (use the unquantised model)"


@dataclass
class LoadedWeights:
    source: str  # the resolved file or folder
    config: ModelConfig
    state_dict: dict[str, Weight]  # Quantized: linear weights kept in blocks (load_weights' weight_format)
    tokenizer: Any  # a transformers tokenizer, or None when the source has none


def load_weights(model: str | None, tokenizer: str | None = None, dtype: torch.dtype = torch.float32,
                 weight_format: str = "fp32") -> LoadedWeights:
    """`dtype`: the state dict's. Pass the engine's: safetensors weights are converted to it tensor
    by tensor as they are read, so no whole second copy in another dtype is ever held.
    `weight_format` (models/quant.py WEIGHT_FORMATS): a GGUF's linear weights that it keeps quantised
    come as `Quantized` blocks, never dequantised; other sources are quantised when the model is
    built."""
    path = model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, tokenizer, dtype, weight_format)
    if path.is_dir():
        return _load_folder(path, tokenizer, dtype)
    if path.exists():
        raise ValueError(f"model {model!r} is neither a .gguf file nor a model folder")
    if model is not None and looks_like_hub_id(model):
        return _load_folder(_download_from_hub(model), tokenizer, dtype)
    raise FileNotFoundError(f"model {model!r} not found: give a .gguf file, a folder or a hub id")


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _download_from_hub(repo_id: str) -> Path:
    return download_folder(repo_id, refuse_unrunnable_config)


def download_folder(repo_id: str, refuse: Callable[[dict[str, Any], Path], None]) -> Path:
    """Config and tokenizer first, then only the weight files the folder loader will read: a model
    `refuse` (config.json, folder → ValueError) turns down costs no weight download."""
    folder = _snapshot(repo_id, _HUB_METADATA)
    refuse(read_config(folder), folder)
    # The snapshot folder is named by its commit: the weights must come from that same commit.
    commit = folder.name if re.fullmatch(r"[0-9a-f]{40}", folder.name) else None
    return _snapshot(repo_id, _hub_weight_patterns(folder), revision=commit)


def _snapshot(repo_id: str, allow_patterns: list[str], revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                      ignore_patterns=_HUB_IGNORE))
    except Exception as exc:  # offline, unknown repo, gated...
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path and could not be fetched from the hub: {exc}"
        ) from exc


def _hub_weight_patterns(folder: Path) -> list[str]:
    index = folder / _INDEX
    return sorted(_index_shards(index)) if index.is_file() else ["model*.safetensors"]


def _load_folder(folder: Path, tokenizer: str | None, dtype: torch.dtype) -> LoadedWeights:
    cfg, files = check_folder(folder)
    config = ModelConfig.from_hf(cfg)
    state_dict: dict[str, Weight] = dict(read_tensors(files, dtype))
    return LoadedWeights(str(folder), config, state_dict, _load_tokenizer(tokenizer or str(folder)))


def check_folder(folder: Path, generating: bool = True) -> tuple[dict[str, Any], list[Path]]:
    """(config dict, weight files) of a Hugging Face folder, after every refusal that reads no
    weight: ValueError says why the folder would not load. `generating=False`: the checkpoint
    need not have an output layer (an embedding model's bare backbone, `Qwen3Model`)."""
    cfg = read_config(folder)
    refuse_unrunnable_config(cfg, folder, generating)
    files = weight_files(folder)
    _refuse_quantised_tensors(files)
    return cfg, files


def read_config(folder: Path) -> dict[str, Any]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    cfg = json.loads(config_file.read_text())
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        # generation_config.json often lists more EOS ids than config.json (e.g. Llama 3).
        gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
        cfg["eos_token_id"] = gen_eos if gen_eos is not None else cfg.get("eos_token_id")
    return cfg


def refuse_unrunnable_config(cfg: dict[str, Any], folder: Path, generating: bool = True) -> None:
    """What config.json alone rules out, refused before any weights are read or downloaded
    (otherwise it surfaces later as a puzzling "weights do not match")."""
    _refuse_architecture(cfg, folder, generating)
    _refuse_quantisation_config(cfg, folder)


def _refuse_architecture(cfg: dict[str, Any], folder: Path, generating: bool = True) -> None:
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    runs = ", ".join(SUPPORTED_ARCHITECTURES)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{folder}: model_type {model_type!r} (architectures {architectures}) is not supported; "
                         f"tokenmill runs {runs}")
    # A supported family with another head (a classifier, a bare encoder) has no lm_head to generate
    # with. *ForConditionalGeneration: a multimodal checkpoint whose text model runs alone (Gemma 3).
    for name in architectures if generating else ():
        if not name.endswith(_GENERATING_HEADS):
            raise ValueError(f"{folder}: architectures entry {name!r} does not generate text; tokenmill runs "
                             f"the {' / '.join('*' + h for h in _GENERATING_HEADS)} checkpoints of {runs}")


def _refuse_quantisation_config(cfg: dict[str, Any], folder: Path) -> None:
    # Multimodal configs keep the language model's settings in text_config.
    for holder in (cfg, cfg.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):  # compression_config: older compressed-tensors
            quant = holder.get(key)
            if quant:
                method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
                raise ValueError(f"{folder}: quantised checkpoint (quant_method {method!r} in config.json {key}); "
                                 f"{_RUNS}")
    if (folder / "quantize_config.json").is_file():  # AutoGPTQ's, from before quantization_config
        raise ValueError(f"{folder}: quantised checkpoint (gptq: AutoGPTQ's quantize_config.json); {_RUNS}")


def weight_files(folder: Path) -> list[Path]:
    """The index's shards when there is one, else every *.safetensors file except Mistral's own
    format (consolidated*.safetensors: the same weights under other names, never read here)."""
    index = folder / _INDEX
    if index.is_file():
        shards = sorted(_index_shards(index))
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{folder}: shard(s) {', '.join(missing)} listed in {_INDEX} are missing")
        return [folder / name for name in shards]
    files = sorted(folder.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    if files and not hf_files:
        raise ValueError(f"{folder}: only Mistral-format consolidated*.safetensors weights; tokenmill reads "
                         "Hugging Face-format model*.safetensors")
    if not hf_files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights")
    return hf_files


def _index_shards(index: Path) -> set[str]:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no weight_map")
    return set(weight_map.values())


def _refuse_quantised_tensors(files: list[Path]) -> None:
    """FP8/FP4 or integer weight matrices, quantised without a quantization_config to say so."""
    for file in files:
        for name, info in safetensors_header(file).items():
            dtype = info["dtype"]
            if dtype in _LOW_PRECISION_DTYPES:
                method = _LOW_PRECISION_DTYPES[dtype]
                raise ValueError(f"{file}: quantised checkpoint ({method}: tensor {name!r} is {dtype}); {_RUNS}")
            if dtype not in _FLOAT_DTYPES and name.endswith("weight"):  # GPTQ/AWQ qweight too
                raise ValueError(f"{file}: quantised checkpoint (integer weights: tensor {name!r} is {dtype}); {_RUNS}")


def read_tensors(files: list[Path], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # One tensor at a time, converted as it is read, so the file's own copy of the weights never
    # exists beside the converted one: peak host memory stays near the final weights.
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                state_dict[name] = f.get_tensor(name).to(dtype)
    return state_dict


def _open_safetensors(file: Path) -> Any:
    from safetensors import safe_open

    try:
        # pread copies each tensor into its own buffer; the default mmap leaves every page read
        # resident (counted against the process) until the file is closed.
        return safe_open(str(file), framework="pt", backend="pread")
    except TypeError:  # older safetensors have no backend argument (mmap only)
        return safe_open(str(file), framework="pt")


def load_tokenizer(source: str | None) -> Any:
    """A tokenizer on its own: from a .gguf file (None: the embedded model's), a Hugging Face
    folder or a hub id; None (with a warning) when there is none."""
    if source is None or source.endswith(".gguf") or (source in NAMED_MODELS and model_path(source).suffix == ".gguf"):
        return _cached_gguf_tokenizer(model_path(source))
    return _load_tokenizer(source)


def model_path(model: str | None) -> Path:
    """--model as a path: None is the embedded default; a named model (`gemma3-270m`) is the file
    its package installed, unless a file or folder of that name exists here."""
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    return named_model_path(model) if model in NAMED_MODELS and not path.exists() else path


def _load_tokenizer(source: str, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    except (OSError, ValueError) as exc:
        log.warning("no tokenizer loaded from %s (%s): only token-id prompts will work", source, exc)
        return None


def _load_gguf(path: Path, tokenizer: str | None, dtype: torch.dtype, weight_format: str) -> LoadedWeights:
    cfg, state_dict = read_gguf(path, weight_format)
    state_dict = {name: t if isinstance(t, Quantized) else t.to(dtype) for name, t in state_dict.items()}
    tok = _load_tokenizer(tokenizer) if tokenizer else _cached_gguf_tokenizer(path)
    return LoadedWeights(str(path), ModelConfig.from_hf(cfg), state_dict, tok)


def file_key(path: Path) -> str:
    """A short key for what is derived from a model file and cached: the file's path, size and
    modification time (hashing gigabytes on every load would cost more than deriving again)."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _cached_gguf_tokenizer(path: Path) -> Any:
    """Converting a GGUF vocabulary to a fast tokenizer takes ~10 s; do it once per file."""
    cache = cache_root() / "tokenizers" / file_key(path)
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
