"""What a job's input becomes: a `BatchRequest` per good line, an `InputError` per bad one, and the
`DocumentOptions` that turn a document into a request."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenmill.engine import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_LOGPROBS
from tokenmill.openai_compat import (
    EMBEDDINGS_URL,
    MAX_COMPLETION_LOGPROBS,
    EmbeddingRequest,
    OpenAIRequest,
    parse_embedding_request,
    parse_request,
    requested_max_tokens,
    structured_outputs_fields,
)
from tokenmill.settings import SettingError, setting

PROMPT_COLUMNS = ("prompt", "text")  # a CSV's prompt column when DocumentOptions.prompt_column names none
ID_COLUMNS = ("custom_id", "id")  # … and its id column, if it has one


class LineError(ValueError):
    """One bad input line; the message has no line prefix (`InputError` adds it)."""


@dataclass(frozen=True)
class DocumentOptions:
    """How documents become requests, and what fills the gaps in every request body."""

    system: str | None = setting(None, "system message for each document (and message lists without one)")
    template: str | None = setting(None, 'user message with "{text}" where the document goes')
    max_tokens: int | None = setting(
        None, f"for bodies without max_tokens, whatever the backend (default {DEFAULT_MAX_TOKENS}); the summary "
        "counts the rows it capped")
    temperature: float | None = setting(
        None, f"for bodies without temperature (default {DEFAULT_TEMPERATURE:g}, OpenAI's; 0 = greedy)")
    model: str | None = None  # sets body["model"] (what an endpoint serves the request with)
    prompt_column: str | None = setting(None, f"the prompt's column (default: {' or '.join(PROMPT_COLUMNS)})",
                                        metavar="NAME")
    id_column: str | None = setting(
        None, f"the custom_id's column (default: {' or '.join(ID_COLUMNS)} if there is one, else line-N)",
        metavar="NAME")
    completions: bool = setting(False, "send documents to /v1/completions as plain prompts instead of chat")
    embed: bool = setting(False, f"send documents to {EMBEDDINGS_URL}: one vector each (the default with an "
                                 "embedding --model)")
    # The body field(s) asking for a structured output (openai_compat.structured_outputs_body), for
    # every body that asks for none of its own.
    structured_outputs: dict[str, Any] | None = None
    # Each answer token's logprob and this many alternatives, asked in each body's own words (chat:
    # logprobs + top_logprobs; completions: logprobs), for every body that asks for none of its own.
    logprobs: int | None = setting(
        None, f"return each answer token's log-probability and the N most likely alternatives (0..{MAX_LOGPROBS}), "
        "OpenAI-shaped, in every result row (rows that say whether they want logprobs keep their own; "
        "/v1/completions rows take 0..5)", metavar="N")

    def __post_init__(self) -> None:
        if self.template is not None and "{text}" not in self.template:
            raise SettingError('{template} must contain "{{text}}" where the document goes, got {got!r}',
                               got=self.template)
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise SettingError("{max_tokens} must be positive, got {got}", got=self.max_tokens)
        if self.temperature is not None and self.temperature < 0:
            raise SettingError("{temperature} must be >= 0, got {got}", got=self.temperature)
        if self.embed and self.completions:
            raise SettingError("{embed} and {completions} send documents to two different endpoints: give one")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SettingError("{logprobs} must be in [0, {high}], got {got}", high=MAX_LOGPROBS, got=self.logprobs)
        if self.completions and self.logprobs is not None and self.logprobs > MAX_COMPLETION_LOGPROBS:
            raise SettingError("{logprobs} {got} with {completions}: /v1/completions takes at most {high} "
                               "alternatives (OpenAI's limit); chat takes {chat_high}", got=self.logprobs,
                               high=MAX_COMPLETION_LOGPROBS, chat_high=MAX_LOGPROBS)

    def fingerprint(self) -> dict[str, Any]:
        """The options that change what a request asks for (hence its result)."""
        settings: dict[str, Any] = {
            "system": self.system, "template": self.template, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "body_model": self.model, "completions": self.completions,
        }
        # Only when set: jobs from before these options still resume.
        later: dict[str, Any] = {
            "structured_outputs": self.structured_outputs, "prompt_column": self.prompt_column,
            "id_column": self.id_column, "logprobs": self.logprobs, "embed": self.embed or None,
        }
        settings.update({name: value for name, value in later.items() if value is not None})
        return settings

    @property
    def default_max_tokens(self) -> int:
        """What a body without max_tokens gets."""
        return self.max_tokens or DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class BatchRequest:
    line: int  # 1-based line number in the input file
    custom_id: str
    url: str  # one of SUPPORTED_URLS
    body: dict[str, Any]
    max_tokens_defaulted: bool = False  # the line gave no max_tokens: DocumentOptions.default_max_tokens
    metadata: dict[str, str] | None = None  # a CSV row's other columns, written back with its result

    @property
    def max_tokens(self) -> int:
        """The most tokens the answer may take (0 for an embedding: nothing is generated)."""
        return 0 if self.url == EMBEDDINGS_URL else requested_max_tokens(self.body)

    @cached_property
    def structured(self) -> bool:
        """Asks for a structured output (its answer is cut short, not valid, if it ends by max_tokens)."""
        return bool(structured_outputs_fields(self.body))

    @cached_property
    def parsed(self) -> OpenAIRequest:
        """The body read and checked for an in-process engine, once (RequestError if it cannot
        serve it). Its field types and ranges are not checked again: `_check_body` did that."""
        return parse_request(self.url, self.body, fields_checked=True)

    @cached_property
    def embedding(self) -> EmbeddingRequest:
        """A /v1/embeddings body read and checked, once (RequestError)."""
        return parse_embedding_request(self.body)


@dataclass(frozen=True)
class InputError:
    line: int
    custom_id: str | None  # None when the line has no readable id
    reason: str

    @property
    def message(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass(frozen=True)
class Entry:
    """What the validation pass keeps of a good line."""

    line: int
    offset: int  # byte offset of the line in the file
    custom_id: str
    cost: int  # rough size in tokens (prompt bytes / 4 + max_tokens), for length buckets
    structured: bool = False  # BatchRequest.structured
    max_tokens_defaulted: bool = False  # BatchRequest.max_tokens_defaulted

