"""Each finished run of a job, timed: a job's summary.json holds only its last run's figures, so
`tokenmill choose` (per candidate) and `tokenmill cascade` (per tier) keep every run's in
`runs.jsonl` beside the job, and sum them for the job's speed and cost."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenmill.jobs import JobOutcome

RUNS_FILE = "runs.jsonl"


def log_run(folder: Path, outcome: JobOutcome) -> None:
    """Keep this run's timing (a run that did no rows is not kept)."""
    engine = outcome.engine
    run = {"rows": outcome.requests.done_this_run, "wall_s": outcome.time.wall_s,
           "prompt_tokens": outcome.tokens.prompt, "completion_tokens": outcome.tokens.completion,
           "prefill_tokens": engine.prefill_tokens, "prefill_s": engine.prefill_s,
           "decode_tokens": engine.decode_tokens, "decode_s": engine.decode_s}
    if run["rows"]:
        with (folder / RUNS_FILE).open("a") as f:
            f.write(json.dumps(run) + "\n")


def timed(folder: Path) -> dict[str, float]:
    """The finished runs' figures, summed."""
    total: Counter[str] = Counter()
    for run in _runs(folder):
        total.update({k: v for k, v in run.items() if v is not None})
    return dict(total)


def projected_wall(t: dict[str, float], prompt: float, output: float) -> float | None:
    """The wall time `prompt` and `output` tokens would take at the rates of the runs `t` (from
    `timed`): prefill and decode each scaled by its own tokens (their split from the engine; by
    output tokens alone for an endpoint). None when nothing was timed."""
    if not t.get("wall_s") or not t.get("completion_tokens"):
        return None
    decode_scale = output / t["completion_tokens"]
    engine_s = t.get("prefill_s", 0.0) + t.get("decode_s", 0.0)
    if not engine_s or not t.get("prompt_tokens"):
        return t["wall_s"] * decode_scale
    prefill_share = t.get("prefill_s", 0.0) / engine_s
    return t["wall_s"] * (prefill_share * prompt / t["prompt_tokens"] + (1 - prefill_share) * decode_scale)


def _runs(folder: Path) -> Iterator[dict[str, Any]]:
    path = folder / RUNS_FILE
    if not path.exists():
        return
    for line in path.read_bytes().splitlines():
        try:
            yield json.loads(line)
        except ValueError:  # torn by a kill mid-append: that run's timing is lost, nothing else
            continue
