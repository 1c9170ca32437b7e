"""A decoder with a sentence-transformers pooling (Qwen3-Embedding's shape: its last token's state,
normalised) embeds through the same Embedder: tiny random models built from transformers configs,
against sentence-transformers (transformers' forward) on the same folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from tokenmill.embed.config import is_embedding_model
from tokenmill.embed.embedder import Embedder
from tokenmill.environment import DEFAULT_EMBEDDING_MODEL, named_model_path

from .test_embedder import cosines, texts

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
SHAPE = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)


def tiny_decoder_folder(folder: Path, family: str, pooling: str, normalize: bool = True, bare: bool = False) -> Path:
    """A random `family` model saved with the MiniLM tokenizer and a modules.json pooling by
    `pooling` (sentence-transformers' key: "lasttoken" or "mean_tokens"). `bare`: saved as the
    backbone alone (no `model.` prefix, no output layer), as Qwen3-Embedding is."""
    from transformers import AutoModel, AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3Config

    config = {"qwen3": lambda: Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True),
              "llama": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False),
              "gemma3": lambda: Gemma3TextConfig(**SHAPE, head_dim=16, sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"])}[family]()
    torch.manual_seed(0)
    model = (AutoModel if bare else AutoModelForCausalLM).from_config(config).eval()
    model.save_pretrained(folder)
    source = named_model_path(DEFAULT_EMBEDDING_MODEL)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": SHAPE["hidden_size"], f"pooling_mode_{pooling}": True}))
    return folder


@pytest.mark.parametrize(("family", "pooling", "bare"), [
    ("qwen3", "lasttoken", True), ("qwen3", "mean_tokens", False), ("llama", "lasttoken", False),
    ("gemma3", "mean_tokens", False),
])
def test_decoder_vectors_match_sentence_transformers(tmp_path: Path, family: str, pooling: str, bare: bool) -> None:
    folder = tiny_decoder_folder(tmp_path / family, family, pooling, bare=bare)
    inputs = texts(40, seed=3, longest=300)
    reference = SentenceTransformer(str(folder), device="cpu").encode(inputs, batch_size=8)
    assert is_embedding_model(str(folder))
    # A small budget: many forwards, the cache grown for a batch of many short inputs.
    embedder = Embedder(str(folder), max_num_batched_tokens=256)
    vectors = embedder.embed(inputs)
    assert vectors.shape == (40, SHAPE["hidden_size"])
    assert cosines(vectors, reference).min() > 0.99999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    alone = embedder.embed(inputs[:1])
    np.testing.assert_allclose(alone[0], vectors[0], atol=1e-5)
    assert embedder.stats.forwards > 2


def test_many_one_token_inputs_fit_a_forward(tmp_path: Path) -> None:
    """Each input takes a KV block of its own: a forward of 200 one-token inputs needs more blocks
    than the budget's tokens fill."""
    folder = tiny_decoder_folder(tmp_path / "qwen3", "qwen3", "lasttoken", normalize=False)
    embedder = Embedder(str(folder), max_num_batched_tokens=256)
    ids = [[t] for t in range(100, 300)]
    vectors = embedder.embed_token_ids(ids)
    one = embedder.embed_token_ids(ids[7:8])
    np.testing.assert_allclose(vectors[7], one[0], atol=1e-5)
    assert embedder.stats.forwards == 2


def test_a_decoder_without_a_pooling_is_refused(tmp_path: Path) -> None:
    folder = tiny_decoder_folder(tmp_path / "llama", "llama", "lasttoken")
    (folder / "modules.json").unlink()
    assert not is_embedding_model(str(folder))
    with pytest.raises(ValueError, match="embeds only as a sentence-transformers folder"):
        Embedder(str(folder))


@pytest.mark.parametrize(("marking", "asked", "refused"), [
    ({"matryoshka_dimensions": [16, 32]}, 32, 24), ({"is_matryoshka": True}, 24, 65), ({}, None, 32),
])
def test_matryoshka_vectors_are_sentence_transformers_truncated(tmp_path: Path, marking: dict[str, object],
                                                                asked: int | None, refused: int) -> None:
    from tokenmill.openai_compat import RequestError, embedding_inputs, parse_embedding_request

    folder = tiny_decoder_folder(tmp_path / "qwen3", "qwen3", "lasttoken")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **marking}))
    embedder = Embedder(str(folder))
    with pytest.raises(RequestError, match=rf"body.dimensions = {refused}: .*(1 to 64|16, 32|not a Matryoshka)"):
        embedding_inputs(parse_embedding_request({"input": "a b", "dimensions": refused}), embedder)
    if asked is None:
        return
    inputs = texts(12, seed=5, longest=200)
    embedding_inputs(parse_embedding_request({"input": inputs, "dimensions": asked}), embedder)
    vectors = embedder.shorten(embedder.embed(inputs), asked)
    truncated = SentenceTransformer(str(folder), device="cpu", truncate_dim=asked)
    reference = truncated.encode(inputs, normalize_embeddings=True)
    assert vectors.shape == reference.shape == (12, asked)
    assert cosines(vectors, reference).min() > 0.99999
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
