"""The judge's work as a batch job of its own: one request per answered row, through the endpoint
backend (retries, a breaker for an endpoint that goes down, exactly-once files), in
`OUT/judge/NAME/`. A re-run judges only what is not judged yet; answers that changed (the
candidate was run again from scratch) are judged afresh."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tokenmill.choose.judge import judge_body, parse_judge_reply
from tokenmill.choose.scorers import Score
from tokenmill.jobs import JobConfig, JobError, run_job
from tokenmill.jobs.backends import EndpointBackend, EndpointSpec, RetryPolicy
from tokenmill.jobs.results import answer_of, final_error_rows, result_rows
from tokenmill.openai_compat import CHAT_URL

JUDGE = "judge"


@dataclass(frozen=True)
class JudgeConfig:
    endpoint: str
    rubric: str
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    retry_for: float = 600.0

    def __post_init__(self) -> None:  # checked before any candidate runs, not after
        if not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--judge-endpoint must be an http:// or https:// URL, got {self.endpoint!r}")
        if self.concurrency < 1:
            raise ValueError(f"--judge-concurrency must be >= 1, got {self.concurrency}")


class Answered(Protocol):
    @property
    def text(self) -> str | None: ...


def judge_scores(judge: JudgeConfig, name: str, answers: Mapping[str, Answered], prompts: Mapping[str, str],
                 expected: Mapping[str, Any], out: Path, console: Console, progress: bool = True) -> dict[str, Score]:
    """A score for every answered row; KeyboardInterrupt when stopped (re-run resumes)."""
    rows: list[dict[str, Any]] = [{"custom_id": i, "method": "POST", "url": CHAT_URL,
             "body": judge_body(judge.rubric, prompts[i], a.text, expected[i], judge.model)}
            for i, a in answers.items() if a.text is not None]
    if not rows:
        return {}
    folder = out / JUDGE / name
    requests = folder / "requests.jsonl"
    content = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    changed = not requests.exists() or requests.read_bytes() != content
    if changed:
        folder.mkdir(parents=True, exist_ok=True)
        requests.write_bytes(content)
    backend = EndpointBackend(EndpointSpec(judge.endpoint, judge.model, judge.api_key, judge.concurrency,
                                           retry=RetryPolicy(retry_for=judge.retry_for)))
    if (down := backend.unreachable()) is not None:
        raise JobError(f"the judge endpoint {judge.endpoint} does not answer ({down}); the candidates' answers "
                       "are kept: re-run once it is up")
    console.print(f"[{name}] judging {len(rows)} answer(s) at {judge.endpoint}", markup=False, highlight=False)
    config = JobConfig(input=requests, output=folder, overwrite=changed, progress=progress)
    if run_job(config, backend, console).interrupted:
        raise KeyboardInterrupt
    return _read_verdicts(folder, [r["custom_id"] for r in rows])


def _read_verdicts(folder: Path, ids: list[str]) -> dict[str, Score]:
    scores = {i: Score(0.0, "not judged") for i in ids}  # a transient failure left for a re-run
    for row in final_error_rows(folder):
        scores[row["custom_id"]] = Score(0.0, "judge failed")
    for row in result_rows(folder):
        scores[row["custom_id"]] = parse_judge_reply(answer_of(row["response"]["body"]) or "")
    return scores
