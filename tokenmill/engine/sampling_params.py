"""Per-request generation settings (the vLLM/OpenAI vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The one default for how many tokens a request may generate, wherever it does not say: the
# offline API, `tokenmill generate`, batch-job rows and server requests without max_tokens.
# Batch answers (labels, extractions, summaries) fit; a longer answer asks for more.
DEFAULT_MAX_TOKENS = 256


@dataclass
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many are generated
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request seed: same seed, same output, whatever the batch
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the text

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
