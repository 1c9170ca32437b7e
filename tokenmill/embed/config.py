"""The embedding engine's settings, validated up front; torch-free, so flags cost no torch import."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenmill.environment import DEFAULT_EMBEDDING_MODEL, NAMED_MODELS
from tokenmill.models.encoder_config import SENTENCE_TRANSFORMERS_MODULES, is_encoder_folder
from tokenmill.settings import SettingError, setting

EMBEDDING_WEIGHT_FORMATS = ("auto", "fp32", "q8")  # a subset of the generation engine's --weight-format
MAX_TRUNCATE = -1  # truncate_prompt_tokens: -1 cuts an input to the model's limit (vLLM's meaning)


@dataclass(frozen=True)
class EmbeddingConfig:
    model: str | None = setting(
        None, f"embedding model: a sentence-transformers or BERT folder, a hub id, or {DEFAULT_EMBEDDING_MODEL} "
        "(the default)")
    max_num_batched_tokens: int = setting(
        1024, "tokens in one forward, counted as the batch padded to its longest input (inputs are sorted by "
        "length first)")
    sort_window: int = setting(
        4096, "inputs sorted by length together: larger wastes less padding, smaller finishes rows sooner")
    max_model_len: int | None = setting(
        None, "longest input in tokens; longer ones are refused unless a row asks for truncation (default: the "
        "model's max_seq_length, capped by its position table)")
    num_threads: int | None = setting(None, "torch CPU threads (default: torch's)")
    weight_format: str = setting(
        "fp32", "fp32: exact; q8: linear layers in 8-bit blocks on the quantised GEMM (faster, vectors within "
        "cosine ~0.999 of fp32: docs/embeddings.md); auto: fp32", EMBEDDING_WEIGHT_FORMATS)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "sort_window", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise SettingError(f"{{{name}}} must be a positive integer, got {{got!r}}", got=value)
        if self.weight_format not in EMBEDDING_WEIGHT_FORMATS:
            raise SettingError("{weight_format} {got} is not offered for embedding models (one of {choices})",
                               got=self.weight_format, choices=", ".join(EMBEDDING_WEIGHT_FORMATS))

    @property
    def weight_bits(self) -> int | None:
        """The linear layers' bits (None: fp32)."""
        return 8 if self.weight_format == "q8" else None


def is_embedding_model(model: str | None) -> bool:
    """Whether `model` names an embedding model, from its name or its folder's config.json (no
    weights, no torch): what `run` and `serve` choose the engine by. A hub id is not looked up."""
    if model is None:
        return False
    path = Path(model).expanduser()
    if model in NAMED_MODELS and not path.exists():
        return NAMED_MODELS[model].embedding
    # A decoder with a sentence-transformers pooling (Qwen3-Embedding) is one too.
    return is_encoder_folder(path) or (path / SENTENCE_TRANSFORMERS_MODULES).is_file()
