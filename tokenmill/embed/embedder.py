"""The embedding engine: `Embedder().embed(texts)` → one vector per text.

A model (a sentence-transformers folder, a bare BertModel folder, a hub id or a named model) is
loaded once: its network (an encoder, models/encoder.py, or a decoder with a sentence-transformers
pooling, engine/hidden_states.py), its pooling (models/pooling.py) and its tokenizer.
Inputs are sorted by length within a window and packed into forwards of at most
`max_num_batched_tokens` (batching.py), so the linear layers never see padding and attention sees
little; vectors come back in the inputs' order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tokenmill.embed.batching import length_sorted_batches
from tokenmill.embed.config import EmbeddingConfig
from tokenmill.embed.inputs import (
    NO_TOKENIZER_LIMIT,
    EmbedderStats,
    EmbeddingInputs,
    matryoshka_dimensions,
)
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


class NetworkShape(Protocol):
    """What the embedder reads of a network's config (EncoderConfig and ModelConfig alike)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...


class EmbeddingNetwork(Protocol):
    """Packed token ids → each token's final state: an encoder, or a decoder (engine/hidden_states.py)."""

    @property
    def config(self) -> NetworkShape: ...

    def __call__(self, batch: PackedBatch) -> torch.Tensor: ...


class Embedder(EmbeddingInputs):
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
        self.dimensions, self.vocab_size = self.model.config.hidden_size, self.model.config.vocab_size
        self.normalize = self.pooling.normalize
        self.max_model_len = self._limit(self.config.max_model_len)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.folder))
        self.tokenizer.model_max_length = NO_TOKENIZER_LIMIT
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
        from tokenmill.engine import DecoderEmbeddingModel

        weight_format = "q8" if self.config.weight_bits == 8 else "fp32"
        return DecoderEmbeddingModel(self.folder, weight_format, self.config.max_num_batched_tokens), pooling

    @classmethod
    def from_config(cls, config: EmbeddingConfig) -> Embedder:
        return cls(**asdict(config))

    def _limit(self, asked: int | None) -> int:
        positions = self.model.config.max_position_embeddings
        if asked is not None and asked > positions:
            raise ValueError(f"max_model_len {asked} exceeds {self.folder.name}'s {positions} positions")
        return asked or min(self.pooling.max_seq_length or positions, positions)

    # ---- token ids → vectors ---------------------------------------------------------------------
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

