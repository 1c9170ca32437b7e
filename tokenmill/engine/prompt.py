"""The forms a prompt comes in, read the same way by every engine (the embedded one, vLLM's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Text, token ids, or {"prompt": text} / {"prompt_token_ids": ids, "prompt": the text they came from}.
Prompt = str | list[int] | dict[str, Any]


def read_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids): ids None when the prompt is text still to tokenize, text None when it came
    as ids alone. ValueError for an empty text or a dict of neither, TypeError for another type."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, None
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return None, [int(t) for t in prompt]
    raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
