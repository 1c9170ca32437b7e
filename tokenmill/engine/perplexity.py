"""Perplexity of the engine's model on a text: what a weight format costs in accuracy.

The text is cut into windows of `window` tokens, each scored from its own start (no carried
context), the way llama.cpp's `llama-perplexity` does; the first half of each window is context
only, so every scored token sees at least `window / 2` tokens before it. Where the model's
tokenizer starts a text with a BOS token (Gemma's does; SmolLM2's does not), the text is tokenized
with it and each window's first token is replaced by it, as llama-perplexity does: the two
engines' figures are then for the same token windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.model_runner import ModelRunner


@dataclass(frozen=True)
class Perplexity:
    value: float
    tokens_scored: int
    windows: int


def perplexity(engine: LLMEngine, text: str, window: int = 512, max_windows: int | None = None) -> Perplexity:
    ids, bos = _tokens(engine.tokenizer, text)
    return perplexity_of_tokens(engine, ids, bos, window, max_windows)


def perplexity_of_tokens(engine: LLMEngine, ids: list[int], bos: int | None, window: int = 512,
                         max_windows: int | None = None) -> Perplexity:
    """The same for a text tokenized elsewhere: given llama.cpp's token ids, the windows
    llama-perplexity scores (the two tokenizers can split a text differently). `bos`: each
    window's first token is replaced by it, where not None."""
    starts = list(range(0, len(ids) - window + 1, window))[:max_windows]
    if not starts:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one window of {window}")
    bs = engine.config.block_size
    # Scored with the attention kernel the engine runs prompts with: the figure is the engine's.
    runner = ModelRunner(engine.runner.model, -(-window // bs), bs, engine.eos_token_ids, engine.device,
                         prefill_kernel=engine.runner.prefill_kernel, kv_dtype=engine.runner.kv_dtype)
    nll, scored = 0.0, 0
    for start in starts:
        tokens = ids[start : start + window]
        if bos is not None:
            tokens[0] = bos
        logprobs = torch.log_softmax(runner.prompt_logits(tokens).float(), dim=-1)
        half = window // 2
        targets = torch.tensor(tokens[half:])
        nll -= logprobs[half - 1 : -1].gather(1, targets[:, None]).sum().item()
        scored += len(targets)
    return Perplexity(math.exp(nll / scored), scored, len(starts))


def _tokens(tokenizer, text: str) -> tuple[list[int], int | None]:  # type: ignore[no-untyped-def]
    """The text's token ids with the special tokens the tokenizer adds, and the BOS id where one
    of them is a leading BOS (None otherwise)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    special = tokenizer(text, add_special_tokens=True)["input_ids"]
    if len(special) == len(plain) + 1 and special[1:] == plain:
        return list(special), special[0]
    return list(plain), None
