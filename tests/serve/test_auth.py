"""--api-key: every route but /health needs `Authorization: Bearer KEY`, the docs included; --no-docs."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, serving


def test_api_key_required(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/models", "/metrics", "/v1/batches"):
                response = httpx.get(f"{server.url}{path}", headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.v1, api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hello", max_tokens=1).usage.completion_tokens == 1


DOCS = ("/docs", "/redoc", "/openapi.json")


def test_the_api_key_covers_the_docs(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, api_key="s3cret") as server:
        for path in DOCS:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = httpx.get(f"{server.url}{path}", headers=headers)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        description = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
    # The description says so: a bearer key on every operation but /health, and their 401s.
    assert description["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert description["security"] == [{"bearer": []}]
    health = description["paths"].pop("/health")["get"]
    assert health["security"] == [] and "401" not in health["responses"]
    for path, operations in description["paths"].items():
        for method, operation in operations.items():
            assert "401" in operation["responses"] and "security" not in operation, (method, path)


def test_no_docs(serve_llm, tmp_path) -> None:
    with serving(serve_llm, tmp_path, docs=False) as server:
        for path in DOCS:
            assert httpx.get(f"{server.url}{path}").status_code == 404, path
        assert httpx.get(f"{server.v1}/models").status_code == 200
