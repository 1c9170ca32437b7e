"""The server driven by the official `openai` client: sync, async, streaming, concurrency,
disconnects, bad requests. Small max_tokens throughout: the CPU engine does ~10 tok/s at batch 1."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncGenerator, Callable

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, Running
from tests.serve_helpers import scrape
from tokenmill.serve.openai_api import _EventStream

PROMPT = "The capital of France is"
LONG_PROMPT = "Here is a list of the countries of Europe and their capital cities, in alphabetical order: " * 2


@pytest.fixture(scope="module")
def client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def metric(server: Running, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_models_and_health(server: Running, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_and_cached_tokens(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0)
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0)
    assert first.object == "text_completion" and first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 3
    assert first.usage.total_tokens == first.usage.prompt_tokens + 3
    assert again.choices[0].text == first.choices[0].text  # greedy
    # The second time the prompt's full blocks come from the prefix cache.
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_stop_and_seed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    text = out.choices[0].message.content
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    stop = text.strip()[1:3] or text[:2]  # some text the greedy answer is sure to contain after its start
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    seeded = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=1.0, seed=7)
              for _ in range(2)]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True))
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "".join(p.choices[0].text for p in pieces) == plain.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length" and pieces[-1].usage is None


def test_logprobs_through_the_openai_client(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and "".join(t.token for t in content).startswith(
        chat.choices[0].message.content)
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2 and bytes(token.bytes).decode() == token.token
        assert token.top_logprobs[0].token == token.token  # greedy: the most likely one
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert "".join(logprobs.tokens) == text.choices[0].text and len(logprobs.token_logprobs) == 3
    assert all(token in top and len(top) == 2 for token, top in zip(logprobs.tokens, logprobs.top_logprobs,
                                                                    strict=True))
    assert logprobs.text_offset[0] == 0
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_64_concurrent_async_requests(server: Running) -> None:
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        semaphore = asyncio.Semaphore(32)

        async def one(i: int):
            async with semaphore:
                return await client.completions.create(
                    model=MODEL, prompt=f"Request number {i}: the weather today is", max_tokens=4,
                    temperature=0.8, seed=i, extra_body={"ignore_eos": True})

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    steps0 = server.state.loop.snapshot.stats.num_steps
    start = time.monotonic()
    outs = asyncio.run(main())
    elapsed = time.monotonic() - start
    assert len({o.id for o in outs}) == 64
    for out in outs:
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
        assert out.usage.prompt_tokens == out.usage.total_tokens - 4 > 5
    # Batched continuously: far fewer engine steps than the 64 × (prefill + 4 decodes) of one at a time.
    steps = server.state.loop.snapshot.stats.num_steps - steps0
    assert steps < 64 * 2, f"{steps} steps for 64 requests in {elapsed:.1f} s"


def wait_idle(server: Running, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = server.state.loop.snapshot
        if snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_usage == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"engine not idle: {server.state.loop.snapshot}")


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def aborted(server: Running) -> float:
    return metric(server, 'tokenmill_requests_finished_total{finish_reason="abort"}')


IGNORE_EOS = {"extra_body": {"ignore_eos": True}}
OTHER_TOKENS = 32


async def beside_an_abandoned_request(server: Running, stream: bool) -> list:
    """Runs a short request beside a 400-token one (streaming or not), then hangs up on the long one
    while it is still generating, alone in the engine. Returns the short request's chunks."""
    client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)

    async def abandoned_request() -> None:
        out = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=stream, **IGNORE_EOS)
        if stream:
            async for _ in out:
                pass

    try:
        other = await client.completions.create(
            model=MODEL, prompt=LONG_PROMPT, max_tokens=OTHER_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, **IGNORE_EOS)
        abandoned = asyncio.create_task(abandoned_request())
        deadline = time.monotonic() + 20
        while server.state.loop.snapshot.num_running < 2:  # both in the batch
            assert time.monotonic() < deadline and not abandoned.done(), server.state.loop.snapshot
            await asyncio.sleep(0.02)
        chunks = [chunk async for chunk in other]
        assert not abandoned.done()  # still generating: it is 400 tokens long
        abandoned.cancel()  # the client goes away: httpx closes the connection
        await asyncio.gather(abandoned, return_exceptions=True)
        return chunks
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_disconnecting_clients_free_their_requests(server: Running, stream: bool) -> None:
    """A client that goes away has its request aborted in the engine at once (not after its 400
    tokens), its KV blocks freed and /metrics saying so; the request beside it is unaffected."""
    aborted0 = aborted(server)
    chunks = asyncio.run(beside_an_abandoned_request(server, stream))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == OTHER_TOKENS
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    wait_for(lambda: aborted(server) == aborted0 + 1, "the abandoned request is aborted", timeout=10)
    wait_idle(server)  # the engine's own counters: nothing running or waiting, no KV block held
    assert not server.state.llm.engine.has_unfinished_requests()
    assert metric(server, "tokenmill_num_requests_running") == 0
    assert metric(server, "tokenmill_kv_cache_usage_ratio") == 0


def test_a_stream_stuck_in_a_send_is_closed_when_its_client_goes_away() -> None:
    """A client that stopped reading (the send blocks) and then disconnects: Starlette cancels the
    send, not the event generator parked at its `yield`; the response must still run the
    generator's cleanup (the abort) at once, not whenever it is garbage-collected."""
    cleaned_up: list[bool] = []
    stuck = asyncio.Event()  # a body send has begun and blocks

    async def events() -> AsyncGenerator[str, None]:
        try:
            while True:
                yield "data: {}\n\n"
        finally:
            cleaned_up.append(True)

    async def receive() -> dict:
        await stuck.wait()  # the client goes away only once the send is stuck
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            stuck.set()
            await asyncio.Event().wait()  # the client's socket buffer is full

    async def main() -> list[bool]:
        generator = events()  # held here, so garbage collection cannot close it for us
        response = _EventStream(generator)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        await asyncio.wait_for(response, timeout=30)  # a response that missed the disconnect fails, not hangs
        return list(cleaned_up)

    assert asyncio.run(main()) == [True]


BAD = [  # (body changes, status, param or code)
    ({"model": "gpt-4o"}, 404, "model_not_found"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 2}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"n": 0}, 400, "n"),
    ({"stop": 5}, 400, "stop"),
    ({"seed": "abc"}, 400, "seed"),
    ({"prompt": ["one", "two"]}, 400, "prompt"),
    ({"prompt": ""}, 400, None),
    ({"prompt": "word " * 600}, 400, "context_length_exceeded"),
    ({"logprobs": 6}, 400, "logprobs"),  # OpenAI's /v1/completions takes 0..5
    ({"logprobs": True}, 400, "logprobs"),  # … as a number
    ({"logprobs": 1, "stream": True}, 400, "stream"),  # logprobs are not streamed
    ({"model": None}, 400, "model"),
    # refused, never coerced or passed on (each was a 200 or a 400 naming no field)
    ({"max_tokens": "5"}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"temperature": 2.5}, 400, "temperature"),
    ({"stop": ["x"] * 1000}, 400, "stop"),
    ({"stop_token_ids": [10**9]}, 400, None),
    ({"seed": 2**80}, 400, "seed"),
    ({"top_k": "3"}, 400, "top_k"),
    ({"ignore_eos": "yes"}, 400, "ignore_eos"),
]


@pytest.mark.parametrize(("change", "status", "what"), BAD)
def test_bad_completion_requests(server: Running, change: dict, status: int, what: str | None) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **change}
    response = httpx.post(f"{server.v1}/completions", json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if what is not None:
        assert what in (error["param"], error["code"]), error


def test_bad_chat_values_and_a_non_finite_number(server: Running) -> None:
    wizard = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(f"{server.v1}/chat/completions", json=wizard)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    assert "role must be one of system, developer, user, assistant" in response.json()["error"]["message"]
    raw = b'{"model": "%s", "prompt": "Hi", "max_tokens": 2, "temperature": Infinity}' % MODEL.encode()
    response = httpx.post(f"{server.v1}/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature", response.text


def test_bad_requests_through_the_client_and_raw(server: Running, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    json_header = {"content-type": "application/json"}
    raw = httpx.post(f"{server.v1}/chat/completions", content=b'{"model": ', headers=json_header)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{server.v1}/nowhere").json()["error"]["type"] == "not_found_error"
    # None of it hurt the server.
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_no_api_key_needed_when_none_is_set(server: Running) -> None:
    assert httpx.get(f"{server.v1}/models").status_code == 200
    assert httpx.get(f"{server.v1}/models", headers={"Authorization": "Bearer anything"}).status_code == 200


def test_vllm_named_metrics_move_with_the_tokenmill_ones(server: Running, client: openai.OpenAI) -> None:
    """Dashboards built for vLLM read the same numbers: vLLM's names, with its model_name label."""
    model = {"model_name": MODEL}

    def vllm(name: str, **labels: str) -> tuple[str, frozenset]:
        return name, frozenset({**model, **labels}.items())

    def plain(name: str, **labels: str) -> tuple[str, frozenset]:
        return name, frozenset(labels.items())

    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = scrape(server)

    def moved(key: tuple[str, frozenset]) -> float:
        return after[key] - before.get(key, 0.0)

    assert moved(vllm("vllm:prompt_tokens_total")) == out.usage.prompt_tokens
    assert moved(vllm("vllm:generation_tokens_total")) == 3
    assert moved(vllm("vllm:request_success_total", finished_reason="length")) == 1
    assert moved(vllm("vllm:request_success_total", finished_reason="stop")) == 0
    assert moved(vllm("vllm:time_to_first_token_seconds_count")) == 1
    assert moved(vllm("vllm:e2e_request_latency_seconds_bucket", le="+Inf")) == 1
    for itl in ("vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert moved(vllm(itl)) == 2  # between token 1 and 2, 2 and 3
    assert moved(vllm("vllm:prefix_cache_queries_total")) >= out.usage.prompt_tokens - 1
    assert moved(vllm("vllm:prefix_cache_hits_total")) == out.usage.prompt_tokens_details.cached_tokens
    assert after[vllm("vllm:num_requests_running")] == after[vllm("vllm:num_requests_waiting")] == 0
    assert 0 <= after[vllm("vllm:kv_cache_usage_perc")] <= 1
    assert vllm("vllm:num_preemptions_total") in after

    # One bookkeeping, two names: every vLLM series is a tokenmill one, value for value.
    pairs = (("tokenmill_prompt_tokens_total", "vllm:prompt_tokens_total"),
             ("tokenmill_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
             ("tokenmill_inter_token_latency_seconds_sum", "vllm:time_per_output_token_seconds_sum"))
    for tokenmill, vllm_name in pairs:
        assert after[plain(tokenmill)] == after[vllm(vllm_name)], vllm_name
    assert after[plain("tokenmill_requests_finished_total", finish_reason="abort")] == after[
        vllm("vllm:request_success_total", finished_reason="abort")]
    text = httpx.get(f"{server.url}/metrics").text  # as Prometheus reads it: the colon kept, the label beside it
    assert f'vllm:generation_tokens_total{{model_name="{MODEL}"}} ' in text
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_metrics(server: Running, client: openai.OpenAI) -> None:
    """Every tokenmill series is there, and each moves by exactly what the requests made imply."""
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_cache_usage_ratio",
                 "tokenmill_prefix_cache_queries_total", "tokenmill_prefix_cache_hits_total",
                 "tokenmill_prompt_tokens_total", "tokenmill_generation_tokens_total",
                 "tokenmill_num_preemptions_total"):
        assert re.search(rf"^{name} ", text, re.MULTILINE), name

    before = scrape(server)
    # Twice the same prompt (the second from the prefix cache), 3 tokens each to "length"; then one
    # that any token ends ("stop" at its first token).
    long = [client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    everything = list(range(server.state.llm.engine.model_config.vocab_size))
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                        extra_body={"stop_token_ids": everything})
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after[key] - before.get(key, 0.0)

    assert [o.choices[0].finish_reason for o in (*long, stopped)] == ["length", "length", "stop"]
    assert stopped.usage.completion_tokens == 1
    usages = [o.usage for o in (*long, stopped)]
    assert moved("tokenmill_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("tokenmill_generation_tokens_total") == sum(u.completion_tokens for u in usages) == 3 + 3 + 1
    assert moved("tokenmill_requests_finished_total", finish_reason="length") == 2
    assert moved("tokenmill_requests_finished_total", finish_reason="stop") == 1
    assert moved("tokenmill_requests_finished_total", finish_reason="abort") == 0
    assert moved("tokenmill_time_to_first_token_seconds_count") == 3  # one first token a request
    assert moved("tokenmill_e2e_request_latency_seconds_count") == 3
    assert moved("tokenmill_inter_token_latency_seconds_count") == 2 + 2 + 0  # gaps between a request's tokens
    assert long[1].usage.prompt_tokens_details.cached_tokens >= 16  # the repeat's full blocks were cached
    assert moved("tokenmill_prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert after[("tokenmill_num_requests_running", frozenset())] == 0
