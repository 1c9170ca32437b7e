"""tokenmill's one HTTP client, aiohttp, as every part that calls a server uses it (a job's
endpoints and Batch API, `tokenmill bench`): a session with one server, what a request that got
no reply raises, and how such a failure reads. Stdlib and aiohttp only: no torch, nothing of
tokenmill's, so any part can import it."""

from __future__ import annotations

from typing import Any

import aiohttp

# What a request that got no reply raises: a refused, reset or dropped connection (aiohttp's own
# timeouts are TimeoutErrors too, as is asyncio's of an attempt as a whole).
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (aiohttp.ClientError, TimeoutError)


def describe_error(exc: BaseException) -> str:
    """A transport failure as a message: its type, and its text where it has one (a timeout of a
    whole attempt has none)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def client_session(base_url: str, timeout: aiohttp.ClientTimeout, limit: int, api_key: str | None = None,
                   headers: dict[str, str] | None = None, **options: Any) -> aiohttp.ClientSession:
    """A session with one server: paths relative to `base_url` (`v1/files`: a base with a path of
    its own keeps it), at most `limit` connections, the key as a bearer token, and the
    environment's proxy. `options`: more of ClientSession's (json_serialize)."""
    headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/") + "/", headers=headers, timeout=timeout,
        connector=aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300), proxy=env_proxy(base_url), **options)


def env_proxy(url: str) -> str | None:
    """The proxy the environment names for `url` (HTTPS_PROXY / HTTP_PROXY, less NO_PROXY), looked
    up once per session: aiohttp's trust_env looks it up, and reads .netrc in a thread, on every
    request, which took the job layer from 0.93× to 0.40× a minimal client's requests/s
    (benchmarks/million_rows.py --only throughput, c=64)."""
    import urllib.request
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    return urllib.request.getproxies().get(parts.scheme)
