"""``tokenmill info MODEL``: what a model file or folder is and whether tokenmill runs it."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from tokenmill.models.info import ModelInfo, describe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?",
        help="what --model takes: a .gguf file, a Hugging Face folder, a named model (gemma3-270m), or a hub id "
        "already in the Hugging Face cache (info never downloads; only headers are read). "
        "Default: the embedded SmolLM2-135M GGUF")
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")


def run(args: argparse.Namespace) -> int:
    info = describe(args.model)
    if args.json:
        print(json.dumps(asdict(info), indent=2))
    else:
        console = Console() if sys.stdout.isatty() else Console(width=200)  # piped: paths and reasons uncut
        console.print(info_table(info))
    return 0


def info_table(info: ModelInfo) -> Table:
    table = Table(title=info.name, show_header=False, box=None, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in _rows(info):
        table.add_row(label, value)
    return table


def _rows(info: ModelInfo) -> list[tuple[str, str]]:
    types = ", ".join(f"{name} ×{count}" for name, count in info.tensor_types.items())
    family = " / ".join(dict.fromkeys(str(x) for x in (info.family, info.model_type, info.architecture) if x))
    rows = [
        ("source", info.source),
        ("format", f"{info.format}: {types}"),
        ("family", family or "unknown"),
        ("parameters", f"{info.parameters:,} ({_si(info.parameters)})"
         f"{', embeddings tied to lm_head' if info.tied_embeddings else ''}"),
        ("weights", f"{_si(info.weight_bytes)}B stored"),
    ]
    if info.layers is not None:
        rows += [
            ("context", f"{info.context_length:,} tokens"),
            ("shape", f"{info.layers} layers, hidden {info.hidden_size}, {info.heads} heads, "
                      f"{info.kv_heads} KV heads × {info.head_dim}, vocab {info.vocab_size:,}"),
            ("KV cache", ", ".join(f"{n:,} B/token {dtype}" for dtype, n in info.kv_bytes_per_token.items())),
        ]
    if info.sliding_window_layers:
        rows.append(("sliding window", f"{info.sliding_window} tokens on {info.sliding_window_layers} of "
                                        f"{info.layers} layers"))
    if info.experts:
        rows.append(("experts", f"{info.experts_per_token} of {info.experts} per token"))
    if info.held_as:
        rows.append(("kept in memory", "; ".join(f"{how} ×{n}" for how, n in info.held_as.items())))
    rows.append(("runs here", "yes" if info.runs else f"no: {info.reason}"))
    return rows


def _si(value: float) -> str:
    """134515008 -> 134.5M: a size at a glance beside the exact count."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:g}"
