"""Per-request generation settings (the vLLM/OpenAI vocabulary)."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field, fields
from typing import Any

# The one default for how many tokens a request may generate, wherever it does not say: the
# offline API, `tokenmill generate`, batch-job rows and server requests without max_tokens.
# Batch answers (labels, extractions, summaries) fit; a longer answer asks for more.
DEFAULT_MAX_TOKENS = 256
# … and for its temperature: OpenAI's, so a row or request means the same here as there. Greedy
# answers ask for temperature 0.
DEFAULT_TEMPERATURE = 1.0
# The most alternatives a request may ask to see per token: OpenAI's top_logprobs limit (and
# vLLM's default max_logprobs), so a body means the same on every engine.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar every generated token must keep valid (vLLM's name and fields): set exactly one.

    `json`: a JSON schema (dict or its text); `json_object`: any JSON object; `choice`: one of
    these strings; `regex`: a full match of this regular expression (Rust `regex` syntax);
    `grammar`: a Lark or GBNF grammar. The request finishes with "stop" as soon as the grammar
    is complete, and with "length" if max_tokens cuts it first (the text is then incomplete)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    choice: list[str] | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            names = ", ".join(f.name for f in fields(self))
            raise ValueError(f"structured_outputs needs exactly one of {names}; got {chosen or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}")
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        """The one field that is set: "json", "json_object", "choice", "regex" or "grammar"."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, text): equal settings share one compiled grammar. Keys keep their order: a schema's
        properties are generated in the order it lists them, so two orders are two grammars."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            return self.kind, jsonlib.dumps(value)
        return self.kind, str(value)


@dataclass
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    temperature: float = DEFAULT_TEMPERATURE  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request seed: same seed, same output, whatever the batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text
    # A grammar the output must follow; it alone decides where the output may end (min_tokens
    # does not apply to it).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's meaning: None = no log-probabilities; N = each output token's logprob and its N most
    # likely alternatives (0 <= N <= MAX_LOGPROBS), in RequestOutput.logprobs.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"SamplingParams.logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
