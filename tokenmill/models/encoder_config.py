"""An encoder's shape, read from config.json; torch-free, so a command can tell an embedding model
from one that generates without loading torch."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENCODER_MODEL_TYPES = ("bert",)
SENTENCE_TRANSFORMERS_MODULES = "modules.json"  # a sentence-transformers folder's list of modules (pooling.py)
# config.json's hidden_act values the encoder computes (models/encoder.py: "gelu" is the exact, erf one).
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> EncoderConfig:
        """ValueError names what this forward does not compute (relative positions, another
        activation) rather than giving other vectors."""
        if cfg.get("model_type") not in ENCODER_MODEL_TYPES:
            raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not an encoder tokenmill runs "
                             f"({', '.join(ENCODER_MODEL_TYPES)})")
        positions = cfg.get("position_embedding_type", "absolute")
        if positions != "absolute":
            raise ValueError(f"{where}: position_embedding_type {positions!r}: tokenmill's encoder has "
                             "absolute positions only")
        act = cfg.get("hidden_act", "gelu")
        if act not in ENCODER_ACTIVATIONS:
            raise ValueError(f"{where}: hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(ENCODER_ACTIVATIONS)})")
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError(f"{where}: hidden_size {cfg['hidden_size']} is not a multiple of "
                             f"num_attention_heads {cfg['num_attention_heads']}")
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"], max_position_embeddings=cfg["max_position_embeddings"],
            type_vocab_size=cfg.get("type_vocab_size", 2), layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            hidden_act=act, pad_token_id=cfg.get("pad_token_id") or 0,
        )


def is_encoder_folder(folder: Path) -> bool:
    """A Hugging Face folder whose config.json is an encoder's (an embedding model)."""
    config = folder / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False
