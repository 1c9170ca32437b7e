"""The embedding engine: `Embedder().embed(texts)` → one vector per text.

A model (a sentence-transformers folder, a bare BertModel folder, a hub id or a named model) is
loaded once: its network (an encoder, models/encoder.py, or a decoder with a sentence-transformers
pooling, decoder_model.py), its pooling (models/pooling.py) and its tokenizer.
Inputs are sorted by length within a window and packed into forwards of at most
`max_num_batched_tokens` (batching.py), so the linear layers never see padding and attention sees
little; vectors come back in the inputs' order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tokenmill.embed.batching import length_sorted_batches
from tokenmill.embed.config import MAX_TRUNCATE, EmbeddingConfig
from tokenmill.environment import DEFAULT_EMBEDDING_MODEL, NAMED_MODELS, model_name, named_model_path
from tokenmill.models.encoder import PackedBatch, build_encoder
from tokenmill.models.encoder_config import ENCODER_MODEL_TYPES, EncoderConfig
from tokenmill.models.loader import (
    download_folder,
    looks_like_hub_id,
    read_config,
    read_tensors,
    refuse_unrunnable_config,
    weight_files,
)
from tokenmill.models.pooling import PoolingConfig, PoolingMode, pool
from tokenmill.models.quant import kernel_available

_NO_TOKENIZER_LIMIT = int(1e30)  # transformers' own "no limit"


class EmbeddingInputError(ValueError):
    """One input the model cannot embed as asked: `index` says which, `reason` why."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"input {index}: {reason}")
        self.index, self.reason = index, reason


class InputTooLong(EmbeddingInputError):
    """An input over the model's limit, and no truncation asked for."""


class EmbeddingNetwork(Protocol):
    """Packed token ids → each token's final state: an encoder, or a decoder (decoder_model.py)."""

    hidden_size: int
    vocab_size: int
    max_positions: int

    def __call__(self, batch: PackedBatch) -> torch.Tensor: ...


@dataclass
class EmbedderStats:
    inputs: int = 0
    tokens: int = 0
    forwards: int = 0
    padded_tokens: int = 0  # attention's [batch × longest] cells, real and padding
    seconds: float = 0.0  # in forwards and pooling (not tokenizing)


class Embedder:
    """Load an embedding model once, then embed batches of texts or token ids.

    `Embedder()` loads the default (all-MiniLM-L6-v2); `Embedder("path/or/hub-id",
    max_num_batched_tokens=4096)` takes any `EmbeddingConfig` field as a keyword.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = EmbeddingConfig(model=model, **config)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.folder = embedding_model_folder(self.config.model)
        self.name = model_name(self.config.model or DEFAULT_EMBEDDING_MODEL)
        if self.config.weight_bits is not None and not kernel_available():
            raise ValueError(f"weight_format {self.config.weight_format} runs on the CPU kernels, which did not "
                             "build here (no C compiler?): use fp32")
        cfg = read_config(self.folder)
        self.model, self.pooling = self._build(cfg)
        self.matryoshka_dimensions = matryoshka_dimensions(cfg)
        self.max_model_len = self._limit(self.config.max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
        self.tokenizer.model_max_length = _NO_TOKENIZER_LIMIT  # the limit is ours to check, with a clearer message
        self.stats = EmbedderStats()

    def _build(self, cfg: dict[str, Any]) -> tuple[EmbeddingNetwork, PoolingConfig]:
        """An encoder pools as its folder says, or by its [CLS] state without one; a decoder is an
        embedding model only by its folder's pooling (modules.json)."""
        pooling = PoolingConfig.read(self.folder)
        if cfg.get("model_type") in ENCODER_MODEL_TYPES:
            encoder_config = EncoderConfig.from_hf(cfg, str(self.folder / "config.json"))
            state = read_tensors(weight_files(self.folder), torch.float32)
            network: EmbeddingNetwork = build_encoder(encoder_config, state, self.config.weight_bits)
            return network, pooling or PoolingConfig(PoolingMode.CLS, normalize=False)
        _refuse_non_embedding(cfg, self.folder)
        from tokenmill.embed.decoder_model import DecoderEmbeddingModel

        weight_format = "q8" if self.config.weight_bits == 8 else "fp32"
        return DecoderEmbeddingModel(self.folder, weight_format, self.config.max_num_batched_tokens), pooling

    @classmethod
    def from_config(cls, config: EmbeddingConfig) -> Embedder:
        return cls(**asdict(config))

    @property
    def dimensions(self) -> int:
        return self.model.hidden_size

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless the model makes vectors of this size: its own, or (a Matryoshka model)
        a leading part it was trained to keep."""
        if dimensions is None or dimensions == self.dimensions:
            return
        allowed = self.matryoshka_dimensions
        if allowed is None:
            raise ValueError(f"{self.name} makes vectors of {self.dimensions} and cannot shorten them (it is not "
                             "a Matryoshka model: its config.json has no is_matryoshka or matryoshka_dimensions)")
        if not 1 <= dimensions <= self.dimensions or (allowed and dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.dimensions}"
            raise ValueError(f"{self.name} makes vectors of {sizes} dimensions, not {dimensions}")

    def shorten(self, vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
        """Matryoshka vectors cut to their first `dimensions` (checked by check_dimensions), made
        unit length again where the model normalises."""
        if dimensions is None or dimensions == vectors.shape[1]:
            return vectors
        cut = vectors[:, :dimensions]
        if not self.pooling.normalize:
            return cut.copy()
        return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)

    def _limit(self, asked: int | None) -> int:
        positions = self.model.max_positions
        if asked is not None and asked > positions:
            raise ValueError(f"max_model_len {asked} exceeds {self.folder.name}'s {positions} positions")
        return asked or min(self.pooling.max_seq_length or positions, positions)

    # ---- inputs → token ids ----------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], truncate: int | None = None) -> list[list[int]]:
        """Each text's token ids, special tokens included, as sentence-transformers tokenizes it.
        `truncate`: cut each to this many tokens (MAX_TRUNCATE: to the model's limit); without it a
        text over the limit raises InputTooLong."""
        limit = self._truncation(truncate)
        ids: list[list[int]] = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        if limit is None:
            self.check_lengths(ids)
            return ids
        long = [i for i, seq in enumerate(ids) if len(seq) > limit]
        if long:  # the tokenizer's own truncation keeps the special tokens at both ends
            cut = self.tokenizer([texts[i] for i in long], add_special_tokens=True, truncation=True,
                                 max_length=limit)["input_ids"]
            for i, seq in zip(long, cut, strict=True):
                ids[i] = seq
        return ids

    def token_ids(self, inputs: Sequence[Sequence[int]], truncate: int | None = None) -> list[list[int]]:
        """Token-id inputs as given (the model's special tokens are the caller's: none are added),
        checked against the vocabulary and the limit, or cut to `truncate` tokens."""
        vocab = self.model.vocab_size
        for i, seq in enumerate(inputs):
            bad = next((t for t in seq if not 0 <= t < vocab), None)
            if bad is not None:
                raise EmbeddingInputError(i, f"token id {bad} is outside the vocabulary of {self.name} "
                                          f"(0..{vocab - 1})")
        limit = self._truncation(truncate)
        ids = [list(seq) if limit is None else list(seq[:limit]) for seq in inputs]
        self.check_lengths(ids)
        return ids

    def _truncation(self, truncate: int | None) -> int | None:
        if truncate is None:
            return None
        if truncate == MAX_TRUNCATE:
            return self.max_model_len
        if not 1 <= truncate <= self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be -1 or in [1, {self.max_model_len}] "
                             f"({self.name}'s limit), got {truncate}")
        return truncate

    def check_lengths(self, ids: Sequence[Sequence[int]]) -> None:
        for i, seq in enumerate(ids):
            if not seq:
                raise EmbeddingInputError(i, "is empty: an embedding needs at least one token")
            if len(seq) > self.max_model_len:
                raise InputTooLong(i, f"{len(seq)} tokens, over {self.name}'s limit of {self.max_model_len}; "
                                   "ask for truncation (truncate_prompt_tokens) to cut it")

    # ---- token ids → vectors ---------------------------------------------------------------------
    def embed(self, texts: Sequence[str], truncate: int | None = None) -> np.ndarray:
        """[len(texts), dimensions] float32, in the texts' order."""
        return self.embed_token_ids(self.tokenize(texts, truncate))

    @torch.inference_mode()
    def embed_token_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Vectors of inputs already within the limit (`tokenize` / `token_ids`)."""
        out = np.empty((len(ids), self.dimensions), dtype=np.float32)
        lengths = [len(seq) for seq in ids]
        for batch in length_sorted_batches(lengths, self.config.max_num_batched_tokens, self.config.sort_window):
            start = time.perf_counter()
            packed = PackedBatch(torch.tensor([t for i in batch for t in ids[i]], dtype=torch.long),
                                 [lengths[i] for i in batch])
            vectors = pool(self.model(packed), packed, self.pooling)
            out[batch] = vectors.numpy()
            self._count(packed, time.perf_counter() - start)
        return out

    def _count(self, packed: PackedBatch, seconds: float) -> None:
        s = self.stats
        s.inputs += len(packed.lengths)
        s.tokens += sum(packed.lengths)
        s.forwards += 1
        s.padded_tokens += len(packed.lengths) * packed.longest
        s.seconds += seconds


def matryoshka_dimensions(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """The sizes a model's vectors may be cut to, as vLLM reads config.json: None (not a
    Matryoshka model), () for any size (`is_matryoshka`), or the listed `matryoshka_dimensions`."""
    listed = cfg.get("matryoshka_dimensions")
    if isinstance(listed, list) and listed:
        return tuple(int(d) for d in listed)
    return () if cfg.get("is_matryoshka") is True else None


def embedding_model_folder(model: str | None) -> Path:
    """--model for embeddings as a folder: None is the default embedding model; a named model is
    the folder its package installed; a hub id is downloaded (config first: a model this cannot
    run costs no weight download)."""
    name = model or DEFAULT_EMBEDDING_MODEL
    path = Path(name).expanduser()
    if name in NAMED_MODELS and not path.exists():
        if not NAMED_MODELS[name].embedding:
            raise ValueError(f"model {name!r} generates text; the embedding models tokenmill knows by name are "
                             + ", ".join(n for n, m in NAMED_MODELS.items() if m.embedding))
        return named_model_path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"embedding model {name!r} is not a folder (a GGUF file generates text)")
    if looks_like_hub_id(name):
        return download_folder(name, _refuse_non_embedding)
    raise FileNotFoundError(f"embedding model {name!r} not found: give a folder, a hub id or "
                            f"{DEFAULT_EMBEDDING_MODEL}")


def _refuse_non_embedding(cfg: dict[str, Any], folder: Path) -> None:
    """Before any weight is downloaded: an encoder this runs, or a decoder family it runs with a
    sentence-transformers pooling."""
    if cfg.get("model_type") in ENCODER_MODEL_TYPES:
        EncoderConfig.from_hf(cfg, f"{folder}/config.json")
        return
    refuse_unrunnable_config(cfg, folder, generating=False)
    if PoolingConfig.read(folder) is None:
        raise ValueError(f"{folder}: a {cfg.get('model_type')} model embeds only as a sentence-transformers "
                         "folder (modules.json and its Pooling config say how its states are pooled)")

