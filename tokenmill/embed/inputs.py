"""What every embedding engine does before and after its forwards, torch-free: texts and token ids
checked against the model's vocabulary and limit (or truncated where asked), Matryoshka sizes
checked and vectors cut to them. `Embedder` (embedder.py) and vLLM's pooling runner
(vllm_engine/embedder.py) both build on `EmbeddingInputs`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.embed.config import MAX_TRUNCATE

NO_TOKENIZER_LIMIT = int(1e30)  # transformers' own "no limit": the limit is ours to check, with a clearer message


class EmbeddingInputError(ValueError):
    """One input the model cannot embed as asked: `index` says which, `reason` why."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"input {index}: {reason}")
        self.index, self.reason = index, reason


class InputTooLong(EmbeddingInputError):
    """An input over the model's limit, and no truncation asked for."""


@dataclass
class EmbedderStats:
    inputs: int = 0
    tokens: int = 0
    forwards: int = 0
    padded_tokens: int = 0  # attention's [batch × longest] cells, real and padding
    seconds: float = 0.0  # in forwards and pooling (not tokenizing)


class EmbeddingInputs:
    """The input side of an embedding model. A subclass sets, before use: `name`, `tokenizer` (a
    transformers tokenizer), `max_model_len`, `vocab_size`, `dimensions`, `normalize` (the model's
    vectors are unit length) and `matryoshka_dimensions` (`matryoshka_dimensions(config.json)`)."""

    name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    dimensions: int
    normalize: bool
    matryoshka_dimensions: tuple[int, ...] | None

    def embed(self, texts: Sequence[str], truncate: int | None = None) -> np.ndarray:
        """[len(texts), dimensions] float32, in the texts' order."""
        return self.embed_token_ids(self.tokenize(texts, truncate))

    def embed_token_ids(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Vectors of inputs already within the limit (`tokenize` / `token_ids`), in their order."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the engine holds outside this process (vLLM's engine process)."""

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
        vocab = self.vocab_size
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
        if not self.normalize:
            return cut.copy()
        return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def matryoshka_dimensions(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """The sizes a model's vectors may be cut to, as vLLM reads config.json: None (not a
    Matryoshka model), () for any size (`is_matryoshka`), or the listed `matryoshka_dimensions`."""
    listed = cfg.get("matryoshka_dimensions")
    if isinstance(listed, list) and listed:
        return tuple(int(d) for d in listed)
    return () if cfg.get("is_matryoshka") is True else None
