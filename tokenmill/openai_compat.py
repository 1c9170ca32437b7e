"""OpenAI request and response bodies ↔ the engine, in one place.

A body (a `tokenmill run` line, a live `/v1/completions` or `/v1/chat/completions` request, a
Batch API line) becomes a prompt and `SamplingParams`; an engine `RequestOutput` becomes the
response body with its `usage`. Batch jobs, the server and its Batch API all go through here,
so one body gets the same answer, and the same refusal naming the same field, on every path.

To support a new body field: read it in `sampling_params` (or refuse it in `UNSUPPORTED_FIELDS`).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from jinja2 import TemplateError

from tokenmill.engine import DEFAULT_MAX_TOKENS, LLM, Prompt, RequestOutput, SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)

# Body fields that change what the caller gets back; refusing beats silently ignoring them.
# (The server takes `stream` off a live request before it gets here; a batch line cannot stream.)
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "response_format", "logprobs", "top_logprobs",
    "logit_bias", "echo", "suffix", "best_of", "stream", "presence_penalty", "frequency_penalty",
)


class RequestError(ValueError):
    """A body the engine cannot serve as asked. The message names the field as `body.<field>`;
    `param` is that field (OpenAI's error `param`), or None when no one field is at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    """An OpenAI-style id: `chatcmpl-…`, `batch_req_…`, `file-…`."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def new_response_id(url: str) -> str:
    return new_id("chatcmpl-" if url == CHAT_URL else "cmpl-")


# ---- requests ------------------------------------------------------------------------------------
def check_request(url: str, body: dict[str, Any]) -> None:
    """Everything about a body that can be checked without the engine (a prompt too long for the
    context is the engine's to refuse). Raises RequestError."""
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, False, 0, [], {}):
            raise RequestError(f"body.{name} is not supported by the embedded engine", name)
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"body.n = {n}: the embedded engine returns one choice per request", "n")
    if url == CHAT_URL:
        chat_messages(body["messages"])
    sampling_params(body)


def requested_max_tokens(body: dict[str, Any]) -> int:
    """max_completion_tokens (OpenAI's newer name), else max_tokens, else the engine's default."""
    return body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """OpenAI (and vLLM's extra) body fields → SamplingParams; RequestError names the body field."""
    stop = body.get("stop") or []
    top_k = body.get("top_k", 0)
    try:
        return SamplingParams(
            max_tokens=requested_max_tokens(body),
            min_tokens=body.get("min_tokens", 0),
            temperature=float(body.get("temperature", 1.0)),  # OpenAI's default
            top_p=float(body.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" -1
            seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop_token_ids=list(body.get("stop_token_ids") or []),
            stop=[stop] if isinstance(stop, str) else list(stop),
        )
    except (TypeError, ValueError) as exc:
        message = str(exc).replace("SamplingParams.", "body.")
        field = re.search(r"body\.(\w+)", message)
        raise RequestError(message, field.group(1) if field else None) from None


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages with string content (text parts joined); other parts are refused."""
    plain = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(
                    f"body.messages[{i}]: only text content parts are supported by the embedded engine", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        plain.append({"role": message["role"], "content": content})
    return plain


def engine_inputs(url: str, body: dict[str, Any], llm: LLM) -> tuple[Prompt, SamplingParams]:
    """The prompt (a chat through the model's own chat template) and the sampling settings."""
    params = sampling_params(body)
    if url != CHAT_URL:
        return body["prompt"], params
    try:
        ids = llm.chat_token_ids(chat_messages(body["messages"]))
    except (TemplateError, TypeError) as exc:
        raise RequestError(f"cannot build the prompt: {exc}", "messages") from None
    return {"prompt_token_ids": ids}, params


# ---- responses -----------------------------------------------------------------------------------
def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def response_body(url: str, out: RequestOutput, model: str, response_id: str | None = None) -> dict[str, Any]:
    """A finished output as the chat.completion or text_completion object OpenAI would return."""
    if url == CHAT_URL:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": None, "finish_reason": out.finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        kind = "text_completion"
    return {"id": response_id or new_response_id(url), "object": kind, "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(out)}
