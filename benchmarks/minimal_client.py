"""The floor of what a job layer costs: read a line, POST its body, append the answer as a row.

    .venv/bin/python benchmarks/minimal_client.py IN.jsonl OUT.jsonl --url http://127.0.0.1:PORT/v1 --concurrency 64

asyncio + aiohttp, N workers sharing one line iterator, the stdlib json (that is what "minimal"
means: no faster parser, no validation, no retries, no resume, buffered writes). Each row is an
OpenAI batch output row. benchmarks/million_rows.py runs it beside `tokenmill run` on the same stub.
"""

import argparse
import asyncio
import itertools
import json

import aiohttp


async def main(args: argparse.Namespace) -> None:
    with open(args.input, "rb") as lines, open(args.output, "ab") as out:
        rows = enumerate(itertools.islice(lines, args.limit))  # one iterator: each line goes to one worker
        base = args.url.rstrip("/")
        connector = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def worker() -> None:
                for n, line in rows:
                    request = json.loads(line)
                    url = base + request.get("url", "/v1/chat/completions").removeprefix("/v1")
                    async with session.post(url, json=request["body"]) as reply:
                        body = await reply.json()
                    row = {"id": f"batch_req_{n}", "custom_id": request["custom_id"], "response": {
                        "status_code": reply.status, "request_id": f"req_{n}", "body": body}, "error": None}
                    out.write(json.dumps(row).encode() + b"\n")
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input")
    parser.add_argument("output")
    parser.add_argument("--url", required=True, help="the endpoint's base URL, /v1 included")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="only the first ROWS lines")
    asyncio.run(main(parser.parse_args()))
