"""OpenAI batch output rows: the result and error rows a job writes, their error codes, and the
readers of a response body that choose, cascade and the summary use."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import orjson

from tokenmill.jobs.input.request import InputError
from tokenmill.openai_compat import new_id


class ErrorCode(StrEnum):
    """The `error.code` of an error row. A transient failure is recorded, then tried again when the
    job is re-run; every other code is final. A request an HTTP server refused is coded by its
    status instead (`http_code`), and is final too."""

    INVALID_INPUT = "invalid_input"  # a bad input line (keyed by its line: it may have no custom_id)
    INVALID_REQUEST = "invalid_request"  # a good line the engine cannot serve (too long, a bad field value)
    REQUEST_TOO_LARGE = "request_too_large"  # over the Batch API's size for one request
    HTTP_400 = "http_400"  # refused as malformed, by a server or its Batch API
    BATCH_ERROR = "batch_error"  # a Batch API's error row that gave no code
    RATE_LIMITED = "rate_limited"
    SERVER_ERROR = "server_error"
    TIMEOUT = "timeout"
    CONNECTION_ERROR = "connection_error"
    BAD_RESPONSE = "bad_response"  # a success without a completion body
    WORKER_ERROR = "worker_error"  # a Ray replica's backend raised on this request


TRANSIENT = frozenset({ErrorCode.RATE_LIMITED, ErrorCode.SERVER_ERROR, ErrorCode.TIMEOUT, ErrorCode.CONNECTION_ERROR,
                       ErrorCode.BAD_RESPONSE, ErrorCode.WORKER_ERROR})


def http_code(status: int) -> str:
    """The code of a request an HTTP server refused (not a 429 or a 5xx: those are ErrorCodes)."""
    return ErrorCode.HTTP_400 if status == 400 else f"http_{status}"


def is_transient(code: str) -> bool:
    return code in TRANSIENT


# An error row's input line is data (`error.line`, as in OpenAI's batch errors), and also leads its
# message for whoever reads the file.
_LINE_PREFIX = "line {}: "


# ---- rows --------------------------------------------------------------------------------------
def result_row(
    custom_id: str, body: dict[str, Any], request_id: str | None = None, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """OpenAI's batch output row; `metadata` (a CSV row's other columns) is the one field added,
    and only to the rows of a CSV job."""
    row = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": request_id or new_id("req_"), "body": body},
        "error": None,
    }
    return row if metadata is None else {**row, "metadata": metadata}


def error_row(
    custom_id: str | None, line: int | None, code: str, message: str, response: dict[str, Any] | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, Any]:
    """OpenAI's error row; the input line, where given, leads the message ("line 7: ...") because a
    bad line may have no custom_id to tie it back. `response` is the server's reply for an HTTP
    error (status_code, request_id, body); `metadata` as in `result_row`."""
    prefix = "" if line is None else _LINE_PREFIX.format(line)
    error: dict[str, Any] = {"code": str(code), "message": prefix + message}
    if line is not None:
        error["line"] = line
    row = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}
    return row if metadata is None else {**row, "metadata": metadata}


def line_of(row: dict[str, Any]) -> int | None:
    """The input line an error row is about."""
    line = (row.get("error") or {}).get("line")
    return line if isinstance(line, int) else None


def input_error_row(error: InputError) -> dict[str, Any]:
    return error_row(error.custom_id, error.line, ErrorCode.INVALID_INPUT, error.reason)


def is_final(row: dict[str, Any]) -> bool:
    return not is_transient((row.get("error") or {}).get("code"))


def finish_reason_of(body: dict[str, Any] | None) -> str | None:
    """The first choice's finish_reason in an OpenAI response body; None where missing."""
    choices = (body or {}).get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first.get("finish_reason") if isinstance(first, dict) else None


def answer_of(body: dict[str, Any] | None) -> str | None:
    """The first choice's text in an OpenAI response body (chat or completions); None where missing."""
    choices = (body or {}).get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict):
        return None
    text = (first.get("message") or {}).get("content") if "message" in first else first.get("text")
    return text if isinstance(text, str) else None


def usage_of(body: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from an OpenAI response body; zeros where missing."""
    usage = (body or {}).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}

    def count(value: Any) -> int:
        return value if isinstance(value, int) else 0

    return count(usage.get("prompt_tokens")), count(details.get("cached_tokens")), count(usage.get("completion_tokens"))


def vectors_of(body: dict[str, Any] | None) -> int:
    """The embeddings in an OpenAI embeddings response body (its "list" of data); 0 for any other."""
    data = (body or {}).get("data") if (body or {}).get("object") == "list" else None
    return len(data) if isinstance(data, list) else 0


def encode_row(row: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # what orjson does not take (an integer past 64 bits): the standard library does
        return (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
