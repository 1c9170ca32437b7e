"""The input processor both engines share, as vLLM v1's engines share its `InputProcessor`: a prompt
in any form (engine/prompt.py) tokenized and checked against the model's context and vocabulary,
into an `EngineRequest`. It keeps no state that changes, so it runs on any thread (the server's
tokenizer threads). What only one engine checks besides (the embedded engine: the KV cache, the
grammar) that engine checks after it.

Nothing here imports torch: vLLM's engine and the embedded one each build one from their tokenizer
and their resolved context.
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.engine.interface import EngineRequest
from tokenmill.engine.prompt import Prompt, read_prompt
from tokenmill.engine.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        """`tokenizer`: the model's (None: token-id prompts only); `vocab_size`: token ids below it
        are the model's."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_prompt_chars = self._max_prompt_chars()

    def _max_prompt_chars(self) -> int | None:
        """Characters beyond which a text surely has more tokens than the context holds, so a huge
        prompt is refused before tokenizing it (seconds per megabyte, holding a thread): no token
        covers more characters than the longest vocabulary entry. Twice that, for normalizers that
        merge characters (NFC); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        longest = max((len(token) for token in self.tokenizer.get_vocab()), default=1)
        return 2 * longest * self.max_model_len

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text prompt of `num_chars` characters that cannot fit the context, without
        tokenizing it (see `max_prompt_chars`). Raises ValueError."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise ValueError(
                f"prompt has {num_chars:,} characters: more than a context of {self.max_model_len:,} tokens can "
                f"hold with this tokenizer (at most {self.max_prompt_chars:,} characters), so it was refused "
                "without tokenizing it"
            )

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of any prompt form; a text too long by its length is refused first."""
        text, ids = read_prompt(prompt)
        if ids is not None:
            return text, ids
        assert text is not None
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        self.check_prompt_chars(len(text))
        return text, list(self.tokenizer.encode(text))

    def process(self, prompt: Prompt, params: SamplingParams, request_id: str, priority: int) -> EngineRequest:
        """Tokenize and check; ValueError naming what is wrong."""
        text, ids = self.tokenize(prompt)
        self.check_token_ids(ids, params)
        return EngineRequest(request_id, text, ids, params, priority, time.monotonic())

    def check_token_ids(self, ids: list[int], params: SamplingParams) -> None:
        """The prompt fits the context with a token left to generate, and every token id the request
        names (its prompt's, its stop tokens) is in the vocabulary."""
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        if len(ids) >= self.max_model_len:  # before the vocabulary scan: a huge list is refused at once
            raise ValueError(
                f"prompt has {len(ids):,} tokens but the context is {self.max_model_len:,} tokens "
                "(at least one must be left to generate)"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary [0, {self.vocab_size})")
