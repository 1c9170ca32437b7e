"""Hidden states → one vector per sequence, as sentence-transformers' folder says: its modules.json
(Transformer, Pooling, then Normalize or not), the Pooling module's config (mean, CLS or last
token) and sentence_bert_config.json's max_seq_length (the length the model was trained to)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.models.encoder import PackedBatch
from tokenmill.models.encoder_config import SENTENCE_TRANSFORMERS_MODULES

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"


class PoolingMode(enum.Enum):
    MEAN = "mean"  # the mean of every token's state
    CLS = "cls"  # the first token's ([CLS])
    LAST = "last"  # the last token's (decoder embedding models)


# 1_Pooling/config.json's switches → the mode; the others (max, mean_sqrt_len, weighted mean) are refused.
_CONFIG_KEYS = {"pooling_mode_mean_tokens": PoolingMode.MEAN, "pooling_mode_cls_token": PoolingMode.CLS,
                "pooling_mode_lasttoken": PoolingMode.LAST}


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool  # to unit length (cosine similarity is then a dot product)
    max_seq_length: int | None = None  # sentence_bert_config.json's, if the folder has one

    @classmethod
    def read(cls, folder: Path) -> PoolingConfig | None:
        """The pooling a sentence-transformers folder declares; None for a folder without
        modules.json (a bare transformers checkpoint). ValueError names a module or mode this
        does not compute."""
        modules_file = folder / SENTENCE_TRANSFORMERS_MODULES
        if not modules_file.is_file():
            return None
        modules = json.loads(modules_file.read_text())
        kinds = [m.get("type") for m in modules]
        pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
        unknown = [k for k in kinds if k not in (_TRANSFORMER_MODULE, _POOLING_MODULE, _NORMALIZE_MODULE)]
        if unknown or pooling is None:
            raise ValueError(f"{modules_file}: tokenmill runs Transformer, Pooling and Normalize modules"
                             + (f", not {unknown[0]}" if unknown else "; this folder has no Pooling module"))
        return cls(_pooling_mode(folder / pooling.get("path", "") / "config.json"),
                   normalize=_NORMALIZE_MODULE in kinds, max_seq_length=_max_seq_length(folder))


def _pooling_mode(config_file: Path) -> PoolingMode:
    config = json.loads(config_file.read_text())
    on = [key for key, value in config.items() if key.startswith("pooling_mode") and value is True]
    if len(on) != 1 or on[0] not in _CONFIG_KEYS:
        raise ValueError(f"{config_file}: tokenmill pools by one of {', '.join(_CONFIG_KEYS)}, got {on or 'none'}")
    return _CONFIG_KEYS[on[0]]


def _max_seq_length(folder: Path) -> int | None:
    config_file = folder / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = json.loads(config_file.read_text()).get("max_seq_length")
    return value if isinstance(value, int) and value > 0 else None


def pool(hidden: torch.Tensor, batch: PackedBatch, config: PoolingConfig) -> torch.Tensor:
    """[T, hidden] of packed sequences → [B, hidden]."""
    lengths = torch.tensor(batch.lengths)
    ends = torch.cumsum(lengths, 0)
    if config.mode is PoolingMode.CLS:
        vectors = hidden.index_select(0, ends - lengths)
    elif config.mode is PoolingMode.LAST:
        vectors = hidden.index_select(0, ends - 1)
    else:
        sums = hidden.new_zeros(len(batch.lengths), hidden.shape[1]).index_add_(0, batch.sequence_of_token, hidden)
        vectors = sums / lengths[:, None].to(hidden.dtype)
    return F.normalize(vectors, p=2, dim=1) if config.normalize else vectors
