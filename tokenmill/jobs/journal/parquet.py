"""Result rows as a parquet part (`--output-format parquet`): one column per field a user loads
next, under one fixed schema, so the parts of a job (and of every job) concatenate —
`pyarrow.dataset.dataset("out/results/")` reads them as one table.

| column | type | from the OpenAI batch output row |
|---|---|---|
| `id` | string | `id` |
| `custom_id` | string | `custom_id` |
| `status_code` | int32 | `response.status_code` |
| `request_id` | string | `response.request_id` |
| `model` | string | `response.body.model` |
| `content` | string | the first choice's text: `message.content` (chat) or `text` (completions) |
| `finish_reason` | string | the first choice's `finish_reason` |
| `prompt_tokens`, `completion_tokens`, `total_tokens` | int64 | `response.body.usage` |
| `cached_tokens` | int64 | `usage.prompt_tokens_details.cached_tokens` |
| `body` | string | `response.body`, the whole reply as JSON text |
| `error_code`, `error_message` | string | `error.code`, `error.message` (null in a result) |
| `metadata` | map<string, string> | a CSV row's other columns (null for other inputs) |

A value the row does not have is null. Errors stay JSONL (errors.jsonl): parts hold results.
An embedding job's parts have one more column, what a vector store ingests: `embedding`,
fixed_size_list<float32>[dimensions], the row's vector (`data[0].embedding`); null for a row with
several inputs, whose vectors are in `body`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.jobs.journal.rows import answer_of, finish_reason_of

SCHEMA = pa.schema([
    ("id", pa.string()), ("custom_id", pa.string()), ("status_code", pa.int32()), ("request_id", pa.string()),
    ("model", pa.string()), ("content", pa.string()), ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("total_tokens", pa.int64()),
    ("cached_tokens", pa.int64()), ("body", pa.string()), ("error_code", pa.string()),
    ("error_message", pa.string()), ("metadata", pa.map_(pa.string(), pa.string())),
])
ROW_GROUP = 10_000  # rows parsed and written at a time: a part is never held in memory whole


def write_parquet(lines: Iterable[bytes], f: BinaryIO) -> int:
    """Write JSONL result rows (the journal's lines) to `f` as one parquet file; returns the rows."""
    rows = 0
    writer: pq.ParquetWriter | None = None
    try:
        for batch in _batches(iter(lines), ROW_GROUP):
            part = table([_loads(line) for line in batch])
            writer = writer or pq.ParquetWriter(f, part.schema, compression="zstd")
            writer.write_table(_conformed(part, writer.schema))
            rows += len(batch)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        pq.write_table(table([]), f, compression="zstd")
    return rows


def table(rows: list[dict[str, Any]]) -> pa.Table:
    """Batch output rows as a table of `SCHEMA`, and `embedding` where they hold vectors."""
    columns: dict[str, list[Any]] = {name: [] for name in SCHEMA.names}
    for row in rows:
        for name, value in _columns(row).items():
            columns[name].append(value)
    result = pa.table(columns, schema=SCHEMA)
    vectors = [_vector(row) for row in rows]
    size = next((len(v) for v in vectors if v is not None), None)
    if size is None:
        return result
    return result.append_column(pa.field("embedding", pa.list_(pa.float32(), size)),
                                pa.array(vectors, type=pa.list_(pa.float32(), size)))


def _conformed(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """A later row group in the part's first schema: its `embedding` column added (all null) when
    its rows hold none, or that of another size refused by the cast."""
    if "embedding" in schema.names and "embedding" not in part.schema.names:
        part = part.append_column(schema.field("embedding"), pa.nulls(part.num_rows, schema.field("embedding").type))
    return part.cast(schema)


def _vector(row: dict[str, Any]) -> list[float] | None:
    """The row's one embedding, as floats (a base64 one decoded); None for none or several."""
    body = (row.get("response") or {}).get("body")
    data = body.get("data") if isinstance(body, dict) and body.get("object") == "list" else None
    if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
        return None
    vector = data[0].get("embedding")
    if isinstance(vector, str):
        return np.frombuffer(base64.b64decode(vector), dtype="<f4").tolist()
    return vector if isinstance(vector, list) else None


def _columns(row: dict[str, Any]) -> dict[str, Any]:
    response = row.get("response") or {}
    body = response.get("body") if isinstance(response.get("body"), dict) else None
    usage = (body or {}).get("usage") or {}
    error = row.get("error") or {}
    metadata = row.get("metadata")
    return {
        "id": row.get("id"), "custom_id": row.get("custom_id"), "status_code": response.get("status_code"),
        "request_id": response.get("request_id"), "model": _text((body or {}).get("model")),
        "content": answer_of(body), "finish_reason": _text(finish_reason_of(body)),
        "prompt_tokens": _int(usage.get("prompt_tokens")), "completion_tokens": _int(usage.get("completion_tokens")),
        "total_tokens": _int(usage.get("total_tokens")),
        "cached_tokens": _int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")),
        "body": None if body is None else _dumps(body),
        "error_code": _text(error.get("code")), "error_message": _text(error.get("message")),
        "metadata": [(str(k), str(v)) for k, v in metadata.items()] if isinstance(metadata, dict) else None,
    }


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63 else None


def _loads(line: bytes) -> dict[str, Any]:
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:  # an integer past 64 bits (output.encode_row wrote it with json)
        return json.loads(line)


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _batches(items: Iterator[bytes], size: int) -> Iterator[list[bytes]]:
    while batch := list(islice(items, size)):
        yield batch
