"""Reading a job's input: each line checked when it is reached, each good line a `BatchRequest`.

Four input forms, all turned into OpenAI batch requests (`custom_id`, `url`, `body`):

- the OpenAI Batch API format: `{"custom_id", "method": "POST", "url", "body"}` a line;
- simple JSONL: `{"id"?, "prompt"}` or `{"id"?, "messages"}` a line;
- plain text: one document a line;
- CSV (or TSV) with a header: a prompt column, an optional id column, the other columns kept
  as the row's metadata. A quoted field may span lines; a record's "line" is where it starts.

`DocumentOptions` say how a document (a text line or a `prompt`) becomes a request, and fill
`max_tokens` / `temperature` / `model` / a structured output / logprobs into every body that lacks
them.

A job reads its input once, as an `InputStream`: a line is parsed, checked and sent in one go,
so the first request leaves within a second of the start whatever the file's size, and what is
kept per line is its custom_id's 8-byte key (for duplicates). Where the whole file must be
checked first (`--strict`, length buckets, choose's sample), `read_input` keeps a small `Entry`
per good line (its byte offset, id and a size estimate) and the work pass re-reads each line.

The input is a local path or a URL (`storage.Location`); every read goes through
`storage.open_input`, which keeps local files on the plain `open`.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import IO, Any

import numpy as np
import orjson

from tokenmill.jobs import storage
from tokenmill.jobs.input.request import (
    ID_COLUMNS,
    PROMPT_COLUMNS,
    BatchRequest,
    DocumentOptions,
    Entry,
    InputError,
    LineError,
)
from tokenmill.jobs.input.seen_ids import SeenIds
from tokenmill.jobs.storage import Location
from tokenmill.openai_compat import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    SUPPORTED_URLS,
    RequestError,
    check_fields,
    check_string,
    check_text,
    printable,
    structured_outputs_fields,
)
from tokenmill.settings import SettingError

FORMATS = ("auto", "batch", "jsonl", "text", "csv")


TEXT_SUFFIXES = (".txt", ".text", ".md")


JSON_LINES_SUFFIXES = (".jsonl", ".ndjson", ".json")  # never read as text, whatever their first line


BATCH_KEYS = frozenset({"custom_id", "body", "url", "method"})  # a line with one is in the batch format


SIMPLE_KEYS = frozenset({"prompt", "messages"})  # … else with one of these, the simple form


CSV_DELIMITERS = {".csv": ",", ".tsv": "\t"}  # by suffix; any other file read as CSV is comma-separated



_DIGITS_AS_ZERO, _LONG_NUMBER = bytes.maketrans(b"0123456789", b"0" * 10), b"0" * 20


IDENTITY_SAMPLE = 1 << 20  # bytes hashed at each end of the input to name it (input_identity)


@dataclass
class InputFile:
    path: Location
    format: str  # "batch" | "jsonl" | "text" | "csv"
    sha256: str
    options: DocumentOptions
    entries: list[Entry] = field(default_factory=list)
    errors: list[InputError] = field(default_factory=list)
    csv_layout: CsvLayout | None = None  # a CSV's header, read by the validation pass

    @property
    def num_lines(self) -> int:
        """Requests the file asks for: good lines plus bad ones."""
        return len(self.entries) + len(self.errors)

    def requests(self, entries: Iterable[Entry]) -> Iterator[BatchRequest]:
        """Re-read and parse the given lines, in the given order, one at a time."""
        with storage.open_input(self.path) as f:
            for entry in entries:
                f.seek(entry.offset)
                if self.csv_layout is not None:
                    yield self.csv_layout.request(self.csv_layout.read_record(f), entry.line, self.options)
                else:
                    yield parse_line(f.readline(), entry.line, self.format, self.options)


@dataclass(frozen=True)
class _Record:
    """One request's worth of input, not yet parsed: a line, or a CSV record."""

    line: int
    offset: int
    size: int  # bytes
    parse: Callable[[SeenIds], BatchRequest]  # raises LineError
    readable_id: Callable[[], str | None]  # for the error row when it does not parse (read only then)


def read_input(
    path: Location,
    options: DocumentOptions,
    input_format: str = "auto",
    check: Callable[[BatchRequest], None] | None = None,
) -> InputFile:
    """Check every line, keeping an `Entry` for each good one; `check` adds the backend's own
    rules (it raises ValueError). For a whole pass before any work: `--strict`, length buckets,
    `tokenmill choose`'s sample, the server's Batch API. A job reads its input as an `InputStream`."""
    stream = InputStream(path, options, input_format, check)
    result = InputFile(path, stream.format, "", options)
    digest = hashlib.sha256()
    for item in stream.read(digest=digest):
        if isinstance(item, InputError):
            result.errors.append(item)
            continue
        record, request = item
        cost = record.size // 4 + request.max_tokens
        result.entries.append(Entry(record.line, record.offset, request.custom_id, cost, request.structured,
                                    request.max_tokens_defaulted))
    result.sha256, result.csv_layout = digest.hexdigest(), stream.csv_layout
    return result


def count_records(path: Location, fmt: str) -> int:
    """The input's non-blank lines, less a CSV's header: its requests, for the progress bar's
    total and a stopped job's summary (a CSV field over several lines counts more than once)."""
    with storage.open_input(path) as f:
        lines = sum(1 for line in f if not line.isspace())
    return max(0, lines - 1) if fmt == "csv" else lines


def input_identity(path: Location) -> dict[str, Any]:
    """What names a job's input without reading all of it: its size, and the sha256 of its first
    and last MiB. (A whole-file hash would hold the first request back by a second a GB, and the
    whole object's download for a URL.) An edit that keeps the size and both ends goes unnoticed;
    docs/jobs.md says so."""
    size = storage.input_size(path)
    digest = hashlib.sha256()
    with storage.open_input(path) as f:
        digest.update(f.read(IDENTITY_SAMPLE))
        if size > IDENTITY_SAMPLE:
            f.seek(max(IDENTITY_SAMPLE, size - IDENTITY_SAMPLE))
            digest.update(f.read())
    return {"size": size, "ends_sha256": digest.hexdigest()}


class InputStream:
    """The input read front to back, each record parsed and checked when it is reached: a job's
    first request goes out as soon as its line is read, and memory does not grow with the file
    (the ids seen are kept in `SeenIds`, ~12 bytes each)."""

    def __init__(
        self, path: Location, options: DocumentOptions, input_format: str = "auto",
        check: Callable[[BatchRequest], None] | None = None,
    ) -> None:
        storage.check_input(path, "input file")  # missing, a folder, unreadable: said as such
        if not storage.input_exists(path):
            raise FileNotFoundError(f"input file {str(path)!r} not found")
        if input_format not in FORMATS:
            raise SettingError("{input_format} must be one of {formats}, got {got!r}", formats=FORMATS,
                               got=input_format)
        self.path, self.options, self.check = path, options, check
        self.format = detect_format(path) if input_format == "auto" else input_format
        self.csv_layout: CsvLayout | None = None  # a CSV's header, once read
        self.seen = SeenIds()
        self.records = 0  # requests read so far, good and bad, skipped ones too
        self.done = False  # read to the end

    def read(
        self, done: DoneLines | None = None, digest: Any = None
    ) -> Iterator[tuple[_Record, BatchRequest] | InputError]:
        """Each good record with its request, each bad one as an `InputError`; records on lines
        `done` names (finished in an earlier run) are counted but not parsed. `digest` sees every byte."""
        with storage.open_input(self.path) as f:
            lines = _TextLines(f, digest)
            records = _csv_records(lines, self, done) if self.format == "csv" else _line_records(lines, self, done)
            for record in records:
                yield self._parse(record)
            for _ in lines:  # a digest covers the whole file, blank lines after the last record too
                pass
        self.done = True

    def has_records(self) -> bool:
        """Whether the input holds any request at all (read up to its first)."""
        records = InputStream(self.path, self.options, self.format).read()
        try:
            return next(records, None) is not None
        finally:
            records.close()

    def _parse(self, record: _Record) -> tuple[_Record, BatchRequest] | InputError:
        try:
            request = record.parse(self.seen)
        except LineError as exc:
            return InputError(record.line, record.readable_id(), str(exc))
        try:
            if self.check is not None:
                self.check(request)  # the backend's own rules
        except ValueError as exc:
            return InputError(record.line, request.custom_id, str(exc))
        return record, request


class _TextLines:
    """A binary file's lines from where it stands, as text, counting lines and bytes (and hashing
    them): `csv.reader` pulls a record's lines through it. Bytes that are not UTF-8 come through
    as surrogates, so the record they are in can be refused on its own."""

    def __init__(self, f: IO[bytes], digest: Any = None) -> None:
        self._f, self._digest = f, digest
        self.offset = f.tell()  # where the next line starts
        self.count = 0  # lines read
        self.raw = b""  # the last line, as read

    def __iter__(self) -> _TextLines:
        return self

    def __next__(self) -> str:
        raw = self.next_raw()
        if not raw:
            raise StopIteration
        return raw.decode("utf-8", errors="surrogateescape")

    def next_raw(self) -> bytes:
        """The next line as read (b"" at the end)."""
        self.raw = raw = self._f.readline()
        if raw:
            if self._digest is not None:
                self._digest.update(raw)
            self.offset += len(raw)
            self.count += 1
        return raw

    def skip(self, count: int) -> int:
        """Pass over `count` lines unread (a resume's done lines: ~0.3 µs a line, not the ~3 µs of
        making each a record); returns how many there were before the end."""
        f, digest, passed, size = self._f, self._digest, 0, 0
        while passed < count and (raw := f.readline()):
            if digest is not None:
                digest.update(raw)
            passed += 1
            size += len(raw)
        self.offset += size
        self.count += passed
        self.raw = b""
        return passed


class DoneLines:
    """The input lines an earlier run finished (`done[line]`, by line number), as runs: a re-run
    passes over each run of done lines at once instead of looking at its lines one by one."""

    def __init__(self, done: np.ndarray) -> None:
        self._done = done
        self._changes = np.flatnonzero(done[1:] != done[:-1]) + 1  # the first line of each run but the first

    def __contains__(self, line: int) -> bool:
        return line < len(self._done) and bool(self._done[line])

    def run_from(self, line: int) -> int:
        """How many lines from `line` on are done (0: `line` is not)."""
        if line not in self:
            return 0
        i = int(np.searchsorted(self._changes, line, side="right"))
        end = int(self._changes[i]) if i < len(self._changes) else len(self._done)
        return end - line


def _line_records(lines: _TextLines, spec: InputStream, done: DoneLines | None) -> Iterator[_Record]:
    while True:
        if done is not None and (run := done.run_from(lines.count + 1)):
            passed = lines.skip(run)  # done lines are non-blank: each was a record
            spec.records += passed
            if passed < run:
                return
            continue
        raw = lines.next_raw()
        if not raw:
            return
        if raw.strip():  # blank lines are not requests
            spec.records += 1
            number = lines.count
            parse = partial(parse_line, raw, number, spec.format, spec.options)
            yield _Record(number, lines.offset - len(raw), len(raw), parse, partial(_readable_id, raw, spec.format))


def _csv_records(lines: _TextLines, spec: InputStream, done: DoneLines | None = None) -> Iterator[_Record]:
    """The header (into `spec.csv_layout`; ValueError for the whole file if it names no prompt
    column), then a `_Record` per non-blank record not `done`."""
    reader = csv.reader(lines, delimiter=CSV_DELIMITERS.get(storage.suffix(spec.path), ","))
    while True:
        start, first_line = lines.offset, lines.count + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            spec.records += 1
            yield _Record(first_line, start, 0, _refuse(f"not CSV ({exc})"), lambda: None)
            continue
        if not any(value.strip() for value in fields):
            continue
        if spec.csv_layout is None:
            spec.csv_layout = CsvLayout.from_header(fields, reader.dialect.delimiter, spec.options)
            continue
        spec.records += 1
        if done is not None and first_line in done:
            continue
        yield _Record(first_line, start, lines.offset - start,
                      partial(spec.csv_layout.request, fields, first_line, spec.options),
                      partial(spec.csv_layout.readable_id, fields))


def _refuse(reason: str) -> Callable[[SeenIds], BatchRequest]:
    def parse(seen: SeenIds) -> BatchRequest:
        raise LineError(reason)
    return parse


@dataclass(frozen=True)
class CsvLayout:
    """A CSV input's header: which column holds the prompt, which the id (if any); the other
    columns are each row's metadata."""

    columns: tuple[str, ...]
    delimiter: str
    prompt: int  # index into columns
    id: int | None

    @classmethod
    def from_header(cls, header: list[str], delimiter: str, options: DocumentOptions) -> CsvLayout:
        columns = tuple(name.lstrip("\ufeff").strip() for name in header)
        doubled = sorted({name for name in columns if columns.count(name) > 1})
        if doubled:
            raise ValueError(f"the CSV header names a column twice: {', '.join(doubled)}")
        prompt = cls._column(columns, options.prompt_column, PROMPT_COLUMNS, "prompt_column")
        if prompt is None:
            raise SettingError("the CSV has no {defaults} column for the prompt; name one with {prompt_column} "
                               "(columns: {columns})", defaults=" or ".join(map(repr, PROMPT_COLUMNS)),
                               columns=", ".join(columns))
        return cls(columns, delimiter, prompt, cls._column(columns, options.id_column, ID_COLUMNS, "id_column"))

    @staticmethod
    def _column(columns: tuple[str, ...], named: str | None, defaults: tuple[str, ...], field: str) -> int | None:
        if named is not None:
            if named not in columns:
                raise SettingError(f"{{{field}}} {{named!r}}: the CSV has no such column (columns: {{columns}})",
                                   named=named, columns=", ".join(columns))
            return columns.index(named)
        return next((columns.index(name) for name in defaults if name in columns), None)

    def read_record(self, f: IO[bytes]) -> list[str]:
        """The record that starts where `f` stands (a quoted field may run over several lines)."""
        return next(csv.reader(_TextLines(f), delimiter=self.delimiter))

    def prompt_of(self, fields: list[str]) -> str:
        return fields[self.prompt].strip()

    def readable_id(self, fields: list[str]) -> str | None:
        if self.id is None or self.id >= len(fields) or not fields[self.id].strip():
            return None
        return fields[self.id].strip() if _is_utf8(fields[self.id]) else None

    def request(
        self, fields: list[str], number: int, options: DocumentOptions, first_seen: SeenIds | None = None
    ) -> BatchRequest:
        if len(fields) != len(self.columns):
            raise LineError(f"{len(fields)} field(s), the header has {len(self.columns)}")
        bad = [name for name, value in zip(self.columns, fields, strict=True) if not _is_utf8(value)]
        if bad:
            raise LineError(f"not UTF-8 (in column {bad[0]!r})")
        custom_id = f"line-{number}" if self.id is None else fields[self.id].strip()
        if not custom_id:
            raise LineError(f"empty id in column {self.columns[self.id or 0]!r}")
        if self.id is not None:  # ids from line numbers are unique as they are
            _check_unique(custom_id, number, first_seen)
        request = _document_request(number, custom_id, self.prompt_of(fields), options)
        metadata = {name: value for i, (name, value) in enumerate(zip(self.columns, fields, strict=True))
                    if i not in (self.prompt, self.id)}
        return replace(request, metadata=metadata)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def detect_format(path: Location) -> str:
    """CSV or text by suffix; text too when the first line does not start with `{` (never for a
    JSON-lines suffix: its bad lines are error rows). Otherwise the first object that is a request
    tells batch (batch keys) from the simple form (`prompt` or `messages`)."""
    suffix = storage.suffix(path)
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in CSV_DELIMITERS:
        return "csv"
    with storage.open_input(path) as f:
        lines = (text for raw in f if (text := raw.decode("utf-8", errors="replace").lstrip("\ufeff").strip()))
        for number, text in enumerate(lines):
            if number == 0 and not text.startswith("{") and suffix not in JSON_LINES_SUFFIXES:
                return "text"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                continue  # a bad line, reported as such; a later one decides
            if isinstance(obj, dict) and obj.keys() & BATCH_KEYS:
                return "batch"
            if isinstance(obj, dict) and obj.keys() & SIMPLE_KEYS:
                return "jsonl"
    return "jsonl"


def parse_line(
    raw: bytes,
    number: int,
    fmt: str,
    options: DocumentOptions,
    first_seen: SeenIds | None = None,
) -> BatchRequest:
    """One input line → a request; raises LineError. `first_seen` collects ids for duplicates."""
    if fmt == "csv":
        raise ValueError("a CSV record is parsed by its CsvLayout, not as a line")
    if fmt == "text":  # ids from line numbers are unique as they are: no need to keep them
        custom_id = f"line-{number}"
        return _document_request(number, custom_id, decode_line(raw, number).strip(), options)
    obj = json_object_line(raw, number)
    if fmt == "batch":
        return _batch_request(number, obj, options, first_seen)
    return _simple_request(number, obj, options, first_seen)


def decode_line(raw: bytes, number: int) -> str:
    """A line as text (a byte-order mark on the first line dropped); LineError if not UTF-8."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return text.lstrip("\ufeff") if number == 1 else text


def json_object_line(raw: bytes, number: int) -> dict[str, Any]:
    """A JSONL line's object; LineError saying where it is not one (also for a blank line)."""
    text = decode_line(raw, number)
    if _LONG_NUMBER in raw.translate(_DIGITS_AS_ZERO):  # orjson would read an integer past 64 bits as a float
        obj = _stdlib_json(text)
    else:
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            obj = _stdlib_json(text)  # what orjson refuses (NaN, Infinity) may still be JSON; its errors say where
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {_json_type(obj)}")
    return obj


def _stdlib_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"not JSON ({_where(exc, text)})") from None


def _where(exc: json.JSONDecodeError, text: str) -> str:
    """Where in the file's line the JSON broke: a column, or its end (the parser counts the line's
    own newline as a second line)."""
    if exc.pos >= len(text.rstrip("\r\n")):
        return f"{exc.msg} at the end of the line"
    return f"{exc.msg} at column {exc.pos + 1}"


def _batch_request(
    number: int, obj: dict[str, Any], options: DocumentOptions, first_seen: SeenIds | None
) -> BatchRequest:
    custom_id = _require(obj, "custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(f'"custom_id" must be a non-empty string, got {json.dumps(custom_id)}')
    _check_string(custom_id, '"custom_id"')
    _check_unique(custom_id, number, first_seen)
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(f'method {json.dumps(method)} is not supported (only "POST")')
    url = _require(obj, "url")
    if url not in SUPPORTED_URLS:
        raise LineError(f"unknown url {json.dumps(url)} (supported: {', '.join(SUPPORTED_URLS)})")
    body = _require(obj, "body")
    if not isinstance(body, dict):
        raise LineError(f'"body" must be a JSON object, got {_json_type(body)}')
    return _request(number, custom_id, url, dict(body), options)


def _simple_request(
    number: int, obj: dict[str, Any], options: DocumentOptions, first_seen: SeenIds | None
) -> BatchRequest:
    raw_id = obj.get("id", f"line-{number}")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
        raise LineError(f'"id" must be a non-empty string or an integer, got {json.dumps(raw_id)}')
    custom_id = str(raw_id)
    _check_string(custom_id, '"id"')
    _check_unique(custom_id, number, first_seen)
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        both = 'has both "prompt" and "messages": give one'
        raise LineError(both if has_prompt else 'missing field "prompt" (or "messages")')
    if has_prompt:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise LineError(f'"prompt" must be a non-empty string, got {json.dumps(prompt)[:60]}')
        _check_string(prompt, '"prompt"')
        return _document_request(number, custom_id, prompt, options)
    if options.completions:
        raise LineError('"messages" need the chat API; drop --completions')
    messages = list(obj["messages"]) if isinstance(obj["messages"], list) else obj["messages"]
    return _request(number, custom_id, CHAT_URL, {"messages": _with_system(messages, options.system)}, options,
                    prefix="")


def _document_request(number: int, custom_id: str, text: str, options: DocumentOptions) -> BatchRequest:
    if not text:
        raise LineError("empty document")
    content = options.template.replace("{text}", text) if options.template else text
    if options.embed:
        return _request(number, custom_id, EMBEDDINGS_URL, {"input": content}, options)
    if options.completions:
        prompt = f"{options.system}\n\n{content}" if options.system else content
        return _request(number, custom_id, COMPLETIONS_URL, {"prompt": prompt}, options)
    messages = _with_system([{"role": "user", "content": content}], options.system)
    return _request(number, custom_id, CHAT_URL, {"messages": messages}, options)


def _request(
    number: int, custom_id: str, url: str, body: dict[str, Any], options: DocumentOptions, prefix: str = "body."
) -> BatchRequest:
    """The request, its body's gaps filled from `options` and checked (LineError naming the field)."""
    if url == EMBEDDINGS_URL:  # nothing to generate: no generation defaults
        if options.model is not None:
            body["model"] = options.model
        request = BatchRequest(number, custom_id, url, body)
        _check_embedding_body(request, prefix)
        return request
    defaulted = "max_tokens" not in body and "max_completion_tokens" not in body
    body = _fill_defaults(body, url, options)
    _check_body(url, body, prefix)
    return BatchRequest(number, custom_id, url, body, max_tokens_defaulted=defaulted)


def _with_system(messages: Any, system: str | None) -> Any:
    if system is None or not isinstance(messages, list):
        return messages
    if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages  # the line's own system message wins
    return [{"role": "system", "content": system}, *messages]


def _fill_defaults(body: dict[str, Any], url: str, options: DocumentOptions) -> dict[str, Any]:
    if options.model is not None:
        body["model"] = options.model
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = options.default_max_tokens  # spelled out: an endpoint's own default may be the context
    if options.temperature is not None and "temperature" not in body:
        body["temperature"] = options.temperature
    if options.structured_outputs is not None and not structured_outputs_fields(body):
        body.update(options.structured_outputs)  # replaces a `response_format` of "text", which asks for none
    if options.logprobs is not None:
        _fill_logprobs(body, url, options.logprobs)
    return body


def _fill_logprobs(body: dict[str, Any], url: str, alternatives: int) -> None:
    """Ask for logprobs in the body's own words, unless it already says whether it wants them."""
    if url == CHAT_URL:
        if body.get("logprobs") is None and body.get("top_logprobs") is None:
            body.update(logprobs=True, top_logprobs=alternatives)
    elif body.get("logprobs") is None:
        body["logprobs"] = alternatives


def _check_body(url: str, body: dict[str, Any], prefix: str = "body.") -> None:
    """Structural checks every backend needs; a server may still refuse what it does not support."""
    if url == CHAT_URL:
        _check_messages(body, prefix)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise LineError(f'missing field "{prefix}prompt"')
        is_ids = isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)
        if isinstance(prompt, list) and not is_ids:
            raise LineError(f"{prefix}prompt must be one string or a list of token ids (one prompt per line)")
        if not is_ids and (not isinstance(prompt, str) or not prompt):
            raise LineError(f"{prefix}prompt must be a non-empty string, got {json.dumps(prompt)[:60]}")
    try:
        check_text(body)  # a lone surrogate: no backend could send or tokenize it
        check_fields(body, url)  # types and ranges, as a server checks them
    except RequestError as exc:
        raise LineError(str(exc).replace("body.", prefix, 1)) from None


def _check_embedding_body(request: BatchRequest, prefix: str) -> None:
    """The body read once, here: the backend takes `request.embedding` as it was read."""
    try:
        request.embedding  # noqa: B018
    except RequestError as exc:
        raise LineError(str(exc).replace("body.", prefix, 1)) from None


def _check_messages(body: dict[str, Any], prefix: str) -> None:
    messages = body.get("messages")
    if messages is None:
        raise LineError(f'missing field "{prefix}messages"')
    if not isinstance(messages, list) or not messages:
        raise LineError(f"{prefix}messages must be a non-empty list, got {json.dumps(messages)[:60]}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise LineError(f'{prefix}messages[{i}] must be an object with a "role"')
        if not isinstance(message.get("content"), (str, list)):
            raise LineError(f'{prefix}messages[{i}] needs a "content" string (or list of parts)')


def _require(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise LineError(f'missing field "{name}"')
    return obj[name]


def _check_string(text: str, where: str) -> None:
    """A value that is not text (a lone surrogate) could be neither sent nor written into a row."""
    try:
        check_string(text, where)
    except RequestError as exc:
        raise LineError(str(exc)) from None


def _check_unique(custom_id: str, number: int, first_seen: SeenIds | None) -> None:
    if first_seen is not None and (first := first_seen.add(custom_id, number)) is not None:
        raise LineError(f"duplicate custom_id {json.dumps(custom_id)} (first seen on line {first})")


def _readable_id(raw: bytes, fmt: str) -> str | None:
    """The id of a bad line when it can be read, for the error row."""
    if fmt == "text":
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    value = obj.get("custom_id" if fmt == "batch" else "id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    return None if isinstance(value, str) and printable(value) != value else str(value)  # not text: no id


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")

