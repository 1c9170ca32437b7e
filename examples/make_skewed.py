"""Print a skewed-length batch job to stdout, for measuring `tokenmill run --order`.

Most requests are short (one review, 8 output tokens); a few are long (a dozen reviews to digest,
64 output tokens). `ignore_eos` makes every request generate exactly its max_tokens, so runs
compare scheduling, not how soon the model happens to stop.

    python examples/make_skewed.py --long-at end > out/skewed-end.jsonl
    python examples/make_skewed.py --long-at spread > out/skewed-spread.jsonl
"""

from __future__ import annotations

import argparse
import json

from make_reviews import review


def request(custom_id: str, text: str, max_tokens: int) -> dict:
    return {
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                 "temperature": 0, "ignore_eos": True},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=40)
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--long-at", choices=("end", "spread"), default="end",
                        help="the long requests last in the file (the worst case), or spread evenly")
    args = parser.parse_args()
    short = [request(f"short-{i}", "Label this review: " + review(i)[1], 8) for i in range(args.short)]
    digest = "Summarise what these customers say:\n"
    long = [
        request(f"long-{i}", digest + "\n".join(review(i * 12 + j)[1] for j in range(12)), 64)
        for i in range(args.long)
    ]
    if args.long_at == "end":
        rows = short + long
    else:
        step = max(1, len(short) // max(1, len(long)))
        rows = []
        for i, row in enumerate(short):
            rows.append(row)
            if i % step == step - 1 and long:
                rows.append(long.pop(0))
        rows += long
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
