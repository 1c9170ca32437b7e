"""What to speculate with: vLLM's `speculative_config` vocabulary, read from the flags or its JSON.

`--speculative-method` and `--num-speculative-tokens` are the short form; `--speculative-config`
takes vLLM's JSON (`{"method": "suffix", "num_speculative_tokens": 8}`), and under `--engine vllm`
reaches vLLM unchanged. The embedded engine runs the model-free methods, `ngram` and `suffix`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.settings import SettingError


class SpeculativeMethod(enum.StrEnum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: the tokens that followed the sequence's last n-gram where it last occurred
    SUFFIX = "suffix"  # SuffixDecoding: a job-wide suffix tree over earlier outputs, and prompt lookup


METHODS = tuple(m.value for m in SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeSettings:
    """The embedded engine's speculation (field names and defaults as vLLM's speculative_config)."""

    method: SpeculativeMethod
    num_speculative_tokens: int  # draft tokens a sequence may propose in one step, at most
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24  # bounds the matched pattern plus the draft
    suffix_decoding_max_cached_requests: int = 10000  # finished requests the tree keeps
    suffix_decoding_max_spec_factor: float = 1.0  # a draft is at most this many times the match length
    suffix_decoding_min_token_prob: float = 0.1  # a draft stops where its estimated probability falls below

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise SettingError(f"{{speculative_config}} {name} must be a positive integer, got {{got!r}}",
                                   got=getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SettingError("{speculative_config} prompt_lookup_min ({low}) is above prompt_lookup_max ({high})",
                               low=self.prompt_lookup_min, high=self.prompt_lookup_max)
        if self.suffix_decoding_max_spec_factor <= 0:
            raise SettingError("{speculative_config} suffix_decoding_max_spec_factor must be > 0, got {got}",
                               got=self.suffix_decoding_max_spec_factor)
        if not 0 <= self.suffix_decoding_min_token_prob < 1:
            raise SettingError("{speculative_config} suffix_decoding_min_token_prob must be in [0, 1), got {got}",
                               got=self.suffix_decoding_min_token_prob)


# A method's draft length where neither --num-speculative-tokens nor the JSON says: vLLM's for suffix
# (its tree depth); ngram's is ours (vLLM requires one).
DEFAULT_DRAFT_TOKENS = {SpeculativeMethod.NGRAM: 8, SpeculativeMethod.SUFFIX: 24}
_KEYS = {f.name for f in fields(SpeculativeSettings)}


def speculative_config(method: str | None, num_speculative_tokens: int | None,
                       config: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's speculative_config from the three settings: the JSON as given, with the short flags
    filling the keys it leaves out (a flag that contradicts it is refused); None: speculation off."""
    merged = dict(config or {})
    for key, value in (("method", method), ("num_speculative_tokens", num_speculative_tokens)):
        if value is None:
            continue
        if key in merged and merged[key] != value:
            flag = "{speculative_method}" if key == "method" else "{num_speculative_tokens}"
            raise SettingError(f"{flag} {{got!r}} contradicts {{speculative_config}}'s {key} {{json!r}}",
                               got=value, json=merged[key])
        merged[key] = value
    if merged.get("method", SpeculativeMethod.OFF) == SpeculativeMethod.OFF:
        if len(merged) > 1 or num_speculative_tokens is not None:
            raise SettingError("{num_speculative_tokens} and {speculative_config} need a method: "
                               "{speculative_method} ngram or suffix")
        return None
    return merged


def speculative_settings(config: dict[str, Any] | None) -> SpeculativeSettings | None:
    """The embedded engine's reading of a speculative_config (None: off); SettingError naming a key
    it does not know, or a method it does not run."""
    if config is None:
        return None
    method = config.get("method")
    if method not in METHODS[1:]:
        raise SettingError("{speculative_config} method {got!r}: the embedded engine speculates with "
                           "'ngram' or 'suffix' (vLLM's draft-model methods run under --engine vllm)", got=method)
    unknown = sorted(set(config) - _KEYS)
    if unknown:
        raise SettingError("{speculative_config}: the embedded engine does not know {unknown}; it reads {known}",
                           unknown=", ".join(unknown), known=", ".join(sorted(_KEYS)))
    method = SpeculativeMethod(method)
    settings = {**config, "method": method}
    settings.setdefault("num_speculative_tokens", DEFAULT_DRAFT_TOKENS[method])
    return SpeculativeSettings(**settings)
