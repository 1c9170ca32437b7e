"""The one OpenAI translation layer: bodies in, response bodies out, refusals naming the field.
(End to end it is exercised by the job and server tests; these pin its rules without a model.)"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from tokenmill.engine import (
    DEFAULT_MAX_TOKENS,
    EngineCapabilities,
    RequestOutput,
    RequestTimings,
    StructuredOutputsParams,
    TokenLogprob,
)
from tokenmill.openai_compat import (
    CHAT_URL,
    COMPLETIONS_URL,
    STRUCTURED_FIELDS,
    STRUCTURED_OUTPUTS_FIELDS,
    OpenAIRequest,
    RequestError,
    body_fields,
    check_fields,
    check_prompt_size,
    check_structured_outputs,
    embedding_response_body,
    engine_inputs,
    parse_embedding_request,
    parse_request,
    response_body,
    sampling_params,
    structured_outputs,
    structured_outputs_body,
    structured_outputs_fields,
    token_decoder,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def output(text: str = "Paris.", finish_reason: str = "stop") -> RequestOutput:
    return RequestOutput("r", None, [1, 2, 3], text, [7, 8], finish_reason, None, 3, 2, 0,
                         RequestTimings(0.0), True)


def test_body_fields_become_sampling_params() -> None:
    params = sampling_params({"max_completion_tokens": 5, "max_tokens": 9, "temperature": 0, "top_k": -1,
                              "stop": "\n", "seed": 3, "min_tokens": 2, "ignore_eos": True})
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, params.seed) == (5, 0.0, 0, ["\n"], 3)
    assert params.min_tokens == 2 and params.ignore_eos
    assert sampling_params({}).max_tokens == DEFAULT_MAX_TOKENS
    assert sampling_params({}).temperature == 1.0  # OpenAI's default
    developer = {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]}
    parsed = parse_request(CHAT_URL, developer)  # OpenAI's newer name for the system role
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"n": 2}, "n", "body.n = 2: tokenmill returns one choice per request"),
    ({"n": 0}, "n", "body.n must be >= 1, got 0"),
    ({"tools": [{"type": "function"}]}, "tools", "body.tools is not supported by tokenmill"),
    ({"logprobs": 3}, "logprobs", "body.logprobs must be true or false, got 3"),
    ({"logprobs": "true"}, "logprobs", 'body.logprobs must be true or false, got "true"'),
    ({"top_logprobs": 2}, "top_logprobs", "body.top_logprobs needs body.logprobs: true"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "body.top_logprobs needs body.logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "body.top_logprobs must be in [0, 20], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "body.top_logprobs must be in [0, 20], got -1"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs", "body.top_logprobs must be an integer, got true"),
    ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", "body.top_logprobs must be an integer, got 2.0"),
    ({"top_p": 2}, "top_p", "body.top_p must be in (0, 1]"),
    ({"max_tokens": 4, "min_tokens": 9}, "min_tokens", "body.min_tokens must be in [0, max_tokens=4]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "body.messages[0]: only text content parts are supported by tokenmill"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages",
     "body.messages[0].role must be one of system, developer, user, assistant"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "body.messages[0].content must be a string"),
    ({"max_tokens": "5"}, "max_tokens", 'body.max_tokens must be an integer, got "5"'),
    ({"max_completion_tokens": True}, "max_completion_tokens", "must be an integer, got true"),
    ({"temperature": float("inf")}, "temperature", "body.temperature must be a finite number"),
    ({"temperature": 2.5}, "temperature", "body.temperature must be in [0, 2], got 2.5"),
    ({"top_k": -2}, "top_k", "body.top_k must be >= -1"),
    ({"seed": 2**80}, "seed", "body.seed must be in"),
    ({"ignore_eos": "yes"}, "ignore_eos", 'body.ignore_eos must be true or false, got "yes"'),
    ({"stop": ["x"] * 17}, "stop", "body.stop: at most 16 items, got 17"),
    ({"stop": [""]}, "stop", 'body.stop[0] must be a non-empty string, got ""'),
    ({"stop_token_ids": ["1"]}, "stop_token_ids", "must be a list of token ids"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be an object"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(CHAT_URL, {**CHAT, **body})
    assert exc.value.param == param and words in str(exc.value)


@pytest.mark.parametrize(("body", "param", "where"), [
    ({"prompt": "a\udfffb"}, "prompt", "body.prompt holds a lone surrogate (\\udfff at character 1)"),
    ({"prompt": ["ok", ["\ud800"]]}, "prompt", "body.prompt[1][0] holds a lone surrogate (\\ud800 at character 0)"),
    ({"stop": ["x", "\udc00"]}, "stop", "body.stop[1] holds"),
    ({"structured_outputs": {"choice": ["yes", "n\udfff"]}}, "structured_outputs",
     "body.structured_outputs.choice[1] holds"),
    ({"user": "\udfff"}, "user", "body.user holds"),  # ignored, yet no text
    ({"a key": {"b\udfff": 1}}, "a key", 'body["a key"]["b\\udfff"] holds'),  # a key: named, escaped
    ({"\udfff": 1}, None, 'body["\\udfff"] holds'),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_where(body: dict[str, Any], param: str | None,
                                                           where: str) -> None:
    """Half a UTF-16 pair is no text: the tokenizer, the grammar compiler and the JSON of an error
    would each fail on it. The message quotes it escaped, so that it can be sent."""
    with pytest.raises(RequestError) as exc:
        parse_request(COMPLETIONS_URL, {"prompt": "hi", **body})
    assert exc.value.param == param and str(exc.value).startswith(where), str(exc.value)
    str(exc.value).encode("utf-8")  # printable


def test_broken_text_is_looked_for_in_any_body_cheaply() -> None:
    """Nested as deep as a parser goes (no recursion limit), and past a long token-id list."""
    deep: Any = "\udfff"
    for _ in range(2000):
        deep = [deep]
    with pytest.raises(RequestError, match=r"body\.x(\[0\]){2000} holds a lone surrogate"):
        parse_request(COMPLETIONS_URL, {"prompt": "hi", "x": deep})
    parse_request(COMPLETIONS_URL, {"prompt": list(range(100_000)), "stop": ["a\x00b"], "x": "é\U0001f600"})


@pytest.mark.parametrize("spec", [{"name": 5}, {"description": ["d"]}, {"strict": "yes"}])
def test_a_json_schema_options_type_is_checked_as_live(spec: dict[str, Any]) -> None:
    """Ignored, but of their type: a batch line refuses what a live request does."""
    name = next(iter(spec))
    body = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}, **spec}}}
    with pytest.raises(RequestError, match=rf"body\.response_format\.json_schema\.{name} must be"):
        parse_request(CHAT_URL, {**CHAT, **body})


@pytest.mark.parametrize(("body", "words"), [
    ({"logprobs": 6}, "body.logprobs must be in [0, 5], got 6"),
    ({"logprobs": True}, "body.logprobs must be an integer, got true"),
    ({"logprobs": "2"}, 'body.logprobs must be an integer, got "2"'),
    ({"logprobs": 2, "top_logprobs": 2}, "body.top_logprobs is a chat field"),
])
def test_completions_logprobs_follow_openais_rules(body: dict[str, Any], words: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(COMPLETIONS_URL, {"prompt": "hi", **body})
    assert words in str(exc.value) and exc.value.param == words.split()[0].removeprefix("body.")
    with pytest.raises(RequestError, match="body.logprobs|body.top_logprobs"):
        check_fields({"prompt": "hi", **body}, COMPLETIONS_URL)  # what a batch line is checked by


@pytest.mark.parametrize(("url", "fields", "expected"), [
    (CHAT_URL, {}, None),
    (CHAT_URL, {"logprobs": False}, None),
    (CHAT_URL, {"logprobs": None, "top_logprobs": None}, None),
    (CHAT_URL, {"logprobs": True}, 0),
    (CHAT_URL, {"logprobs": True, "top_logprobs": 20}, 20),
    (COMPLETIONS_URL, {}, None),
    (COMPLETIONS_URL, {"logprobs": 0}, 0),
    (COMPLETIONS_URL, {"logprobs": 5}, 5),
])
def test_logprobs_in_each_endpoints_words(url: str, fields: dict[str, Any], expected: int | None) -> None:
    body = {**(CHAT if url == CHAT_URL else {"prompt": "hi"}), **fields}
    assert parse_request(url, body).params.logprobs == expected
    assert parse_request(url, body, fields_checked=True).params.logprobs == expected


def test_a_body_whose_fields_were_checked_is_not_checked_again() -> None:
    body = {**CHAT, "n": "2"}
    with pytest.raises(RequestError, match='body.n must be an integer, got "2"'):
        parse_request(CHAT_URL, body)
    with pytest.raises(RequestError, match="body.n = 2: tokenmill returns one choice"):  # the rest is checked
        parse_request(CHAT_URL, body, fields_checked=True)
    parsed = parse_request(COMPLETIONS_URL, {"prompt": [1, 2], "max_tokens": 3, "guided_regex": "a"},
                           fields_checked=True)
    assert (parsed.prompt, parsed.messages, parsed.params.max_tokens) == ([1, 2], None, 3)
    assert parsed.structured_outputs_field == "guided_regex"


def test_a_prompt_is_sized_by_every_engine_and_a_structured_output_compiled_where_declared() -> None:
    asked: list[Any] = []

    def does_not_compile(structured_outputs: StructuredOutputsParams) -> None:
        raise ValueError("structured_outputs.regex does not compile")

    class Engine:
        def __init__(self, capabilities: EngineCapabilities) -> None:
            self.capabilities = capabilities

        def check_prompt_chars(self, num_chars: int) -> None:
            asked.append(num_chars)

    class Model:
        def __init__(self, engine: Engine) -> None:
            self.engine = engine

    parsed = parse_request(CHAT_URL, {**CHAT, "guided_regex": "("})
    vllm_like, embedded_like = Model(Engine(EngineCapabilities())), Model(Engine(EngineCapabilities(does_not_compile)))
    for model in (vllm_like, embedded_like):
        check_prompt_size(parsed, model)  # type: ignore[arg-type]
        check_prompt_size(parse_request(COMPLETIONS_URL, {"prompt": "abc"}), model)  # type: ignore[arg-type]
    assert asked == [2, 3, 2, 3]
    check_structured_outputs(parsed, vllm_like)  # type: ignore[arg-type]  # vLLM compiles it when submitted
    with pytest.raises(RequestError, match=r"^body.guided_regex does not compile") as exc:
        check_structured_outputs(parsed, embedded_like)  # type: ignore[arg-type]
    assert exc.value.param == "guided_regex"


def test_chat_goes_through_the_template_and_a_broken_one_is_a_request_error() -> None:
    class Model:
        def chat_token_ids(self, messages: list[dict[str, str]], template_kwargs: Any = None) -> list[int]:
            if template_kwargs:
                return [-1, *template_kwargs.values()]
            if messages[0]["role"] == "assistant":
                raise TypeError("the template wants a user first")
            return [len(m["content"]) for m in messages]

    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]}
    def inputs(url: str, body: dict[str, Any]) -> Any:
        return engine_inputs(parse_request(url, body), Model())  # type: ignore[arg-type]

    prompt, params = inputs(CHAT_URL, parts)
    assert prompt == {"prompt_token_ids": [3]} and params.max_tokens == DEFAULT_MAX_TOKENS  # text parts joined
    with_kwargs = {**parts, "chat_template_kwargs": {"enable_thinking": 7}}
    assert inputs(CHAT_URL, with_kwargs)[0] == {"prompt_token_ids": [-1, 7]}
    assert inputs(COMPLETIONS_URL, {"prompt": "x"})[0] == "x"
    with pytest.raises(RequestError, match="cannot build the prompt") as exc:
        inputs(CHAT_URL, {"messages": [{"role": "assistant", "content": "x"}]})
    assert exc.value.param == "messages"


def test_response_bodies_and_usage() -> None:
    chat = response_body(CHAT_URL, output(), "m", response_id="chatcmpl-1")
    assert chat["id"] == "chatcmpl-1" and chat["object"] == "chat.completion" and chat["model"] == "m"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                "logprobs": None, "finish_reason": "stop"}]
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    text = response_body(COMPLETIONS_URL, output(finish_reason="length"), "m")
    assert text["id"].startswith("cmpl-") and text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "Paris." and text["choices"][0]["finish_reason"] == "length"


LOGPROBS = [TokenLogprob(7, -0.25, ((7, -0.25), (9, -1.75))), TokenLogprob(8, -0.5, ((4, -0.375), (8, -0.5)))]
TOKENS = {7: "Par", 8: "ís", 9: "Lon", 4: "is"}


def test_chat_logprobs_in_openais_shape() -> None:
    out = output("París")
    out.logprobs = LOGPROBS
    body = response_body(CHAT_URL, out, "m", token_text=TOKENS.__getitem__)
    assert body["choices"][0]["logprobs"] == {"content": [
        {"token": "Par", "logprob": -0.25, "bytes": [80, 97, 114], "top_logprobs": [
            {"token": "Par", "logprob": -0.25, "bytes": [80, 97, 114]},
            {"token": "Lon", "logprob": -1.75, "bytes": [76, 111, 110]}]},
        {"token": "ís", "logprob": -0.5, "bytes": [195, 173, 115], "top_logprobs": [  # UTF-8 bytes
            {"token": "is", "logprob": -0.375, "bytes": [105, 115]},
            {"token": "ís", "logprob": -0.5, "bytes": [195, 173, 115]}]},
    ]}
    assert response_body(CHAT_URL, output(), "m")["choices"][0]["logprobs"] is None  # not asked


def test_completion_logprobs_in_openais_legacy_shape() -> None:
    out = output("París")
    out.logprobs = [*LOGPROBS, TokenLogprob(9, -3.0, ((7, -0.1),))]  # the chosen token below the top: added
    body = response_body(COMPLETIONS_URL, out, "m", token_text=TOKENS.__getitem__)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["Par", "ís", "Lon"],
        "token_logprobs": [-0.25, -0.5, -3.0],
        "top_logprobs": [{"Par": -0.25, "Lon": -1.75}, {"is": -0.375, "ís": -0.5}, {"Par": -0.1, "Lon": -3.0}],
        "text_offset": [0, 3, 5],
    }
    out.logprobs = []
    assert response_body(COMPLETIONS_URL, out, "m")["choices"][0]["logprobs"] == {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_tokens_show_as_their_own_text() -> None:
    class Tokenizer:
        calls = 0

        def decode(self, ids: list[int]) -> str:
            Tokenizer.calls += 1
            return f"<{ids[0]}>"

    text_of = token_decoder(Tokenizer())
    assert [text_of(3), text_of(3), text_of(4)] == ["<3>", "<3>", "<4>"] and Tokenizer.calls == 2  # remembered
    assert token_decoder(None)(3) == "token_id:3"  # a model without a tokenizer


# ---- structured outputs --------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["good", "bad"]}}, "required": ["label"]}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": False}}},  # no name
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"json_object": True, "regex": None}}, StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"grammar": 'start: "y" | "n"'}}, StructuredOutputsParams(grammar='start: "y" | "n"')),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutputsParams(json='{"type": "integer"}')),  # vLLM takes text
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
    ({"response_format": {"type": "text"}, "guided_choice": ["a"]}, StructuredOutputsParams(choice=["a"])),
    ({"guided_choice": None, "response_format": None}, None),  # null is absent
])
def test_every_structured_output_form(fields: dict[str, Any], expected: StructuredOutputsParams | None) -> None:
    body = {**CHAT, **fields}
    assert structured_outputs(body) == expected
    assert sampling_params(body).structured_outputs == expected
    assert bool(structured_outputs_fields(body)) == (expected is not None)
    parsed = parse_request(CHAT_URL, body)
    assert isinstance(parsed, OpenAIRequest) and parsed.params.structured_outputs == expected
    assert parsed.structured_outputs_field == (structured_outputs_fields(body) or [None])[0]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "xml"}}, "response_format",
     'body.response_format must be an object with a "type" of text, json_object, json_schema, got {"type": "xml"}'),
    ({"response_format": "json"}, "response_format", "body.response_format must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     'body.response_format.json_schema must be an object with a "schema", got null'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "body.response_format.json_schema.schema must be a JSON schema (an object), got null"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}}, "response_format",
     'body.response_format.json_schema.schema must be a JSON schema (an object), got "{}"'),
    ({"structured_outputs": ["a"]}, "structured_outputs", "body.structured_outputs must be an object with one of"),
    ({"structured_outputs": {}}, "structured_outputs", "body.structured_outputs needs exactly one of"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs",
     "body.structured_outputs needs exactly one of json, json_object, choice, regex, grammar; got ['choice', 'regex']"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs",
     "body.structured_outputs.choice must be a non-empty list of non-empty strings"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "body.structured_outputs.structural_tag is not supported by tokenmill"),
    ({"guided_choice": []}, "guided_choice", "body.guided_choice must be a non-empty list of non-empty strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "body.guided_choice must be a non-empty list"),
    ({"guided_choice": "a,b"}, "guided_choice", "body.guided_choice must be a non-empty list"),
    ({"guided_json": [1]}, "guided_json", "body.guided_json must be a JSON schema (an object), got list"),
    ({"guided_regex": ""}, "guided_regex", "body.guided_regex must be a non-empty string"),
    ({"guided_grammar": 5}, "guided_grammar", "body.guided_grammar must be a non-empty string"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "response_format",
     "body.response_format and body.guided_json both ask for a structured output: give one"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "structured_outputs",
     "body.structured_outputs and body.guided_regex both ask"),
])
def test_structured_output_refusals_name_the_field(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(RequestError) as exc:
        parse_request(CHAT_URL, {**CHAT, **fields})
    assert exc.value.param == param and words in str(exc.value)


def test_each_structured_output_field_is_checked_by_its_table_entry() -> None:
    """The table's check is the one `structured_outputs` reads a field with: the same setting, and
    the same refusal, as the server's schema for it describes."""
    by_name = {field.name: field for field in STRUCTURED_FIELDS}
    assert tuple(by_name) == STRUCTURED_OUTPUTS_FIELDS
    good = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"},
            "guided_json": SCHEMA, "guided_choice": ["a"], "guided_regex": "a", "guided_grammar": 'start: "a"'}
    bad = {"response_format": {"type": "json_schema"}, "structured_outputs": {"json": {}, "regex": "a"},
           "guided_json": [1], "guided_choice": ["a", 1], "guided_regex": "", "guided_grammar": 5}
    assert good.keys() == bad.keys() == by_name.keys()
    for name, field in by_name.items():
        assert field.check({name: good[name]}) == structured_outputs({name: good[name]}) is not None, name
        with pytest.raises(RequestError) as exc:
            field.check({name: bad[name]})
        with pytest.raises(RequestError) as read:
            parse_request(CHAT_URL, {**CHAT, name: bad[name]})
        assert exc.value.param == read.value.param == name and str(exc.value) == str(read.value), name
        assert field.check({name: None}) is None and field.urls == (CHAT_URL, COMPLETIONS_URL)
    assert {f.name for f in body_fields(COMPLETIONS_URL)} >= set(STRUCTURED_OUTPUTS_FIELDS)


@pytest.mark.parametrize("setting", [
    StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(choice=["a", "b"]), StructuredOutputsParams(regex="[a-z]+"),
    StructuredOutputsParams(grammar='start: "x"'),
])
def test_a_setting_written_as_a_body_field_reads_back_the_same(setting: StructuredOutputsParams) -> None:
    fields = structured_outputs_body(setting)
    assert structured_outputs({**CHAT, **fields}) == setting
    if setting.json is not None:  # what any OpenAI-compatible server knows, with the name OpenAI requires
        assert fields["response_format"]["json_schema"]["name"]


# ---- /v1/embeddings bodies ---------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "texts", "ids", "listed"), [
    ({"input": "one text"}, ["one text"], None, False),
    ({"input": ["a", "b"]}, ["a", "b"], None, True),
    ({"input": [101, 7, 102]}, None, [[101, 7, 102]], False),
    ({"input": [[101, 102], [7]]}, None, [[101, 102], [7]], True),
])
def test_embedding_inputs_in_each_of_openais_shapes(body: dict[str, Any], texts: list[str] | None,
                                                     ids: list[list[int]] | None, listed: bool) -> None:
    request = parse_embedding_request(body)
    assert (request.texts, request.token_ids, request.listed) == (texts, ids, listed)
    assert request.encoding_format == "float" and request.dimensions is None


@pytest.mark.parametrize(("body", "message", "param"), [
    ({}, 'missing field "body.input"', "input"),
    ({"input": ""}, "body.input is an empty string", "input"),
    ({"input": ["a", ""]}, r"body.input\[1\] is an empty string", "input"),
    ({"input": []}, "body.input must be a string, a list of strings", "input"),
    ({"input": ["a", 3]}, "body.input mixes kinds", "input"),
    ({"input": [[1], [-2]]}, r"body.input\[1\] must be token ids", "input"),
    ({"input": [[1], []]}, r"body.input\[1\] is an empty list", "input"),
    ({"input": ["x"] * 2049}, "at most 2048 inputs in one request, got 2049", "input"),
    ({"input": "a", "encoding_format": "int8"}, "body.encoding_format must be one of float, base64", "encoding_format"),
    ({"input": "a", "dimensions": 0}, "body.dimensions must be >= 1", "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "body.truncate_prompt_tokens must be -1", "truncate_prompt_tokens"),
    ({"input": "a\udfff"}, "lone surrogate", "input"),
])
def test_bad_embedding_bodies_are_refused_naming_the_field(body: dict[str, Any], message: str, param: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        parse_embedding_request(body)
    assert info.value.param == param


def test_embedding_responses_are_openais_shape() -> None:
    vectors = np.array([[0.5, -0.25], [1.0, 0.1]], dtype=np.float32)
    body = embedding_response_body(parse_embedding_request({"input": ["a", "b"]}), vectors, "m", 7)
    assert body == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]},
                             {"object": "embedding", "index": 1, "embedding": [1.0, vectors[1, 1].item()]}]}
    encoded = embedding_response_body(parse_embedding_request({"input": "a", "encoding_format": "base64"}),
                                      vectors[:1], "m", 1)
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, vectors[0])
