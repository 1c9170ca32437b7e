"""The OpenAPI description (/openapi.json) says what the server does: the errors it answers with,
their OpenAI shape, the content types; and schemathesis, fuzzing a live server from that
description, finds no answer that contradicts it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from click.testing import CliRunner
from hypothesis.configuration import set_hypothesis_home_dir
from schemathesis.cli import schemathesis as schemathesis_cli

from tests.serve.conftest import MODEL, Running, serving
from tokenmill.embed.embedder import Embedder
from tokenmill.openai_compat import (
    EMBEDDING_FIELDS,
    EMBEDDINGS_URL,
    RESPONSE_FORMAT_TYPES,
    STRUCTURED_FIELDS,
    STRUCTURED_OUTPUTS_FIELDS,
    STRUCTURED_OUTPUTS_KINDS,
)

ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorBody"}


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """The same routes over an embedding model, served as MODEL too."""
    with serving(Embedder(), tmp_path_factory.mktemp("embed-state")) as running:
        yield running


def operations(description: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, ops in description["paths"].items() for method, op in ops.items()]


def test_the_description_declares_the_errors_the_server_answers(server: Running) -> None:
    description = httpx.get(f"{server.url}/openapi.json").json()
    assert "422" not in str(description) and "HTTPValidationError" not in description["components"]["schemas"]
    for path, method, op in operations(description):
        responses = op["responses"]
        assert responses["500"]["content"]["application/json"]["schema"] == ERROR_SCHEMA, (path, method)
        assert "401" not in responses  # no --api-key: no 401 (test_auth.py has the other case)
        if "requestBody" in op:
            assert {"400", "413"} <= responses.keys(), (path, method)
        if "{" in path:
            assert responses["404"]["content"]["application/json"]["schema"] == ERROR_SCHEMA, (path, method)
    paths = description["paths"]
    for route in ("/v1/completions", "/v1/chat/completions"):
        assert paths[route]["post"]["responses"]["200"]["content"].keys() == {"application/json", "text/event-stream"}
        assert {"400", "404", "413"} <= paths[route]["post"]["responses"].keys()
    assert paths[EMBEDDINGS_URL]["post"]["responses"]["200"]["content"].keys() == {"application/json"}
    health = paths["/health"]["get"]["responses"]
    assert "content" not in health["200"] and "content" not in health["503"]  # empty bodies
    assert paths["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}
    assert paths["/v1/files/{file_id}/content"]["get"]["responses"]["200"]["content"].keys() == {
        "application/octet-stream"}
    assert {"get", "post"} <= paths["/v1/files"].keys() and "delete" in paths["/v1/files/{file_id}"]


def test_the_structured_output_fields_are_declared_as_openai_compat_reads_them(server: Running) -> None:
    """Each as its entry in openai_compat's table writes it (pydantic adds only a title): no model
    of the server's own, which would check a value a second time, in other words than a batch line's."""
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    assert not {"ResponseFormat", "StructuredOutputs", "JSONSchemaFormat"} & schemas.keys()
    for body in ("ChatBody", "CompletionBody"):
        declared = schemas[body]["properties"]
        for field in STRUCTURED_FIELDS:
            assert {k: v for k, v in declared[field.name].items() if k != "title"} == field.schema, (body, field.name)
    response_format, structured_outputs = (schemas["ChatBody"]["properties"][name]
                                           for name in ("response_format", "structured_outputs"))
    assert tuple(response_format["properties"]["type"]["enum"]) == RESPONSE_FORMAT_TYPES
    assert response_format["properties"]["json_schema"]["required"] == ["schema"]  # `name` may be left out
    assert tuple(structured_outputs["properties"]) == STRUCTURED_OUTPUTS_KINDS
    assert structured_outputs["additionalProperties"] is False  # vLLM's other options are refused
    embedding = schemas["EmbeddingBody"]
    assert embedding["required"] == ["model", "input"]
    for field in EMBEDDING_FIELDS:
        assert {k: v for k, v in embedding["properties"][field.name].items() if k != "title"} == field.schema
    assert STRUCTURED_OUTPUTS_FIELDS == ("response_format", "structured_outputs", "guided_json", "guided_choice",
                                         "guided_regex", "guided_grammar")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("TRACE", "/v1/models", "GET"),
    ("POST", "/health", "GET"),
    ("DELETE", "/v1/batches", "GET, POST"),  # two routes on one path: both methods
    ("OPTIONS", "/v1/files/file-x", "DELETE, GET"),
])
def test_a_method_the_path_lacks_is_a_405_naming_those_it_has(server: Running, method: str, path: str,
                                                               allow: str) -> None:
    response = httpx.request(method, f"{server.url}{path}")
    assert response.status_code == 405 and response.headers["allow"] == allow
    assert response.json()["error"]["type"] == "invalid_request_error"


# ---- fuzzing -----------------------------------------------------------------------------------
# The CLI, not schemathesis' pytest integration: `schemathesis.pytest.from_fixture` fails on pytest 9
# (it sets `Function._nodeid`, which is gone), and `APIOperation.as_strategy` alone runs no coverage
# phase, the one that sends boundary values and unexpected methods (it found a 500 on long ids).
SEED = 20240611
EXAMPLES = 25  # per operation and phase: about 15 s in all
MAX_TOKENS = 4  # what a generated completion may ask for: the model really runs
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "unsupported_method", "allow_header_conformance")


def short_completion(body: Any) -> Any:
    """A generated completion (or embeddings) body, made to reach the model and to keep it brief:
    it names the served model (a random one is a 404 before anything else is looked at) and asks
    for at most MAX_TOKENS tokens. Everything else is left as generated, invalid values included."""
    if not isinstance(body, dict) or not {"prompt", "messages", "input"} & body.keys():
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    if "input" in body:  # an embedding: nothing to cut short
        return body
    if not {"max_tokens", "max_completion_tokens"} & body.keys():
        body["max_tokens"] = MAX_TOKENS  # the default, 256, takes seconds
    for key in ("max_tokens", "max_completion_tokens"):
        if type(body.get(key)) is int and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    return body


@pytest.fixture
def completion_hook() -> Iterator[None]:
    @schemathesis.hook
    def map_body(_: schemathesis.HookContext, body: Any) -> Any:
        return short_completion(body)

    yield
    schemathesis.hooks.unregister(map_body)


@pytest.fixture
def scratch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Where schemathesis and hypothesis keep their caches: not in the checkout."""
    monkeypatch.chdir(tmp_path)  # schemathesis: .schemathesis/ in the working directory
    set_hypothesis_home_dir(tmp_path / ".hypothesis")  # hypothesis: where pytest started, by default
    yield
    set_hypothesis_home_dir(None)


@pytest.mark.slow
@pytest.mark.parametrize("served", ["server", "embedding_server"])
def test_schemathesis_finds_nothing_the_description_does_not_allow(
        served: str, request: pytest.FixtureRequest, completion_hook: None, scratch_dir: None) -> None:
    """`schemathesis run` (its CLI, in this process) over the live server, a generation model's
    and an embedding model's: all its phases (examples, boundary values and unexpected methods,
    random requests, valid and not), with a fixed seed."""
    server: Running = request.getfixturevalue(served)
    result = CliRunner().invoke(schemathesis_cli, [
        "--no-color", "run", f"{server.url}/openapi.json", "--checks", ",".join(CHECKS), "--seed", str(SEED),
        "--max-examples", str(EXAMPLES), "--generation-database", "none"])
    assert result.exit_code == 0, result.output[max(result.output.find(" FAILURES "), 0):]
