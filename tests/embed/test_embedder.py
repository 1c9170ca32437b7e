"""The embedding engine on the real all-MiniLM-L6-v2 against sentence-transformers on the same
folder: every vector within cosine 0.99999, from 1 token to the 512-token position limit, alone
and batched, in every batching mode; truncation, token-id inputs and the errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from tokenmill.embed.batching import length_sorted_batches
from tokenmill.embed.config import MAX_TRUNCATE, EmbeddingConfig, is_embedding_model
from tokenmill.embed.embedder import Embedder, embedding_model_folder
from tokenmill.embed.inputs import EmbeddingInputError, InputTooLong

_TEXT = ("the of and a to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "write go see number no way could people than first water been call who oil its now find long down day "
         "did get come made may part embedding café naïve 東京 😀")
WORDS = _TEXT.split()


def texts(count: int, seed: int = 0, longest: int = 600) -> list[str]:
    """`count` texts of 1 to `longest` words, a few of each size band."""
    rng = random.Random(seed)
    sizes = [1, 2, 3] + [rng.choice((rng.randint(1, 30), rng.randint(30, 200), rng.randint(200, longest)))
                         for _ in range(count - 3)]
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in sizes]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(max_model_len=512)


@pytest.fixture(scope="module")
def sentence_transformer(embedder: Embedder) -> SentenceTransformer:
    model = SentenceTransformer(str(embedder.folder), device="cpu")
    model.max_seq_length = 512
    return model


@pytest.fixture(scope="module")
def corpus(embedder: Embedder) -> list[str]:
    """60 texts from 3 tokens (one word, [CLS] and [SEP]) to exactly the 512-token limit."""
    chosen = texts(80)
    kept = [t for t, ids in zip(chosen, embedder.tokenizer(chosen)["input_ids"], strict=True) if len(ids) <= 512]
    one_token = [w for w in WORDS if len(embedder.tokenizer(w)["input_ids"]) == 3]
    longest = " ".join(random.Random(2).choice(one_token) for _ in range(510))  # + [CLS] and [SEP]
    return kept[:59] + [longest]


def test_the_corpus_spans_one_word_to_the_limit(embedder: Embedder, corpus: list[str]) -> None:
    lengths = sorted(len(ids) for ids in embedder.tokenize(corpus))
    assert len(corpus) >= 50 and lengths[0] == 3 and lengths[-1] == 512


@pytest.mark.parametrize("config", [
    {},  # the defaults: sorted windows under a 2,048-token budget
    {"max_num_batched_tokens": 1},  # every input alone
    {"max_num_batched_tokens": 100_000},  # one forward, padded to the longest
    {"sort_window": 1},  # no sorting: file order
    {"sort_window": 7, "max_num_batched_tokens": 700},
])
def test_vectors_match_sentence_transformers(config: dict[str, int], embedder: Embedder, corpus: list[str],
                                             sentence_transformer: SentenceTransformer) -> None:
    embedder.config = EmbeddingConfig(max_model_len=512, **config)
    try:
        mine = embedder.embed(corpus)
    finally:
        embedder.config = EmbeddingConfig(max_model_len=512)
    theirs = sentence_transformer.encode(corpus, normalize_embeddings=False, batch_size=16)
    assert mine.dtype == np.float32 and mine.shape == (len(corpus), 384)
    assert cosines(mine, theirs).min() > 0.99999
    np.testing.assert_allclose(np.linalg.norm(mine, axis=1), 1.0, rtol=1e-5)  # the folder's Normalize module


def test_one_text_alone_is_the_same_vector_as_in_a_batch(embedder: Embedder, corpus: list[str]) -> None:
    batched = embedder.embed(corpus)
    for i in (0, 17, len(corpus) - 1):
        assert cosines(embedder.embed([corpus[i]]), batched[i:i + 1])[0] > 0.999999


def test_the_default_limit_and_truncation_are_sentence_transformers(corpus: list[str]) -> None:
    """The folder's max_seq_length (256) is the default limit, and truncation to it gives the
    vector sentence-transformers gives at its default settings."""
    embedder = Embedder()
    assert embedder.max_model_len == 256
    long = [t for t in corpus if len(embedder.tokenizer(t)["input_ids"]) > 256]
    with pytest.raises(InputTooLong, match="over all-minilm-l6-v2's limit of 256"):
        embedder.embed(long[:1])
    theirs = SentenceTransformer(str(embedder.folder), device="cpu").encode(long)
    assert cosines(embedder.embed(long, truncate=MAX_TRUNCATE), theirs).min() > 0.99999
    cut = embedder.tokenize(long[:1], truncate=100)[0]
    assert len(cut) == 100 and cut[0] == embedder.tokenizer.cls_token_id and cut[-1] == embedder.tokenizer.sep_token_id


def test_token_id_inputs_are_taken_as_given(embedder: Embedder, corpus: list[str]) -> None:
    ids = embedder.tokenize(corpus[:5])
    np.testing.assert_array_equal(embedder.embed_token_ids(embedder.token_ids(ids)), embedder.embed(corpus[:5]))
    with pytest.raises(EmbeddingInputError, match="input 1: token id 30522 is outside the vocabulary") as info:
        embedder.token_ids([[101, 102], [101, 30522, 102]])
    assert info.value.index == 1
    with pytest.raises(EmbeddingInputError, match="input 0: is empty"):
        embedder.token_ids([[]])
    assert embedder.token_ids([list(range(1, 600))], truncate=MAX_TRUNCATE)[0] == list(range(1, 513))


def test_batches_hold_the_budget_and_cover_every_input_once() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 300) for _ in range(1000)]
    for budget, window in ((512, 64), (2048, 4096), (1, 10)):
        batches = list(length_sorted_batches(lengths, budget, window))
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
            assert len({i // window for i in b}) == 1  # never across windows


def test_models_are_told_apart_without_loading_them(embedder: Embedder) -> None:
    assert is_embedding_model("all-minilm-l6-v2") and is_embedding_model(str(embedder.folder))
    assert not is_embedding_model("smollm2") and not is_embedding_model(None)
    with pytest.raises(ValueError, match="'smollm2' generates text"):
        embedding_model_folder("smollm2")
