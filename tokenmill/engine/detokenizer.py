"""Incremental detokenisation, so stop strings (and streaming) see text as it is generated."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Text of a growing list of output ids, without re-decoding everything each step."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._stream = None
        self._ids: list[int] = []
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=True)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it added (may be "" mid-way through a character)."""
        if self.tokenizer is None:
            return ""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id) or ""
        else:  # slow tokenizers: decode everything again
            self._ids.append(token_id)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=True)
            piece = full[len(self.text) :]
        self.text += piece
        return piece
