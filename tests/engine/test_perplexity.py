"""Perplexity scores the token windows llama.cpp's llama-perplexity scores."""

from __future__ import annotations

from typing import Any

from tokenmill.engine.perplexity import _tokens


class _Tokenizer:
    """Splits on spaces; `bos`: the id it puts first when asked for special tokens."""

    def __init__(self, bos: int | None) -> None:
        self.bos = bos

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, Any]:
        ids = [len(word) for word in text.split()]
        return {"input_ids": ([self.bos] if add_special_tokens and self.bos is not None else []) + ids}


def test_a_tokenizer_that_starts_with_bos_gets_it_as_llama_perplexity_does() -> None:
    assert _tokens(_Tokenizer(bos=2), "a bb ccc") == ([2, 1, 2, 3], 2)


def test_a_tokenizer_without_bos_is_scored_on_the_text_alone() -> None:
    assert _tokens(_Tokenizer(bos=None), "a bb ccc") == ([1, 2, 3], None)
