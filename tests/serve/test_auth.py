"""--api-key: every route but /health needs `Authorization: Bearer KEY`."""

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
