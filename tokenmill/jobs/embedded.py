"""The in-process backend: the whole job fed to the continuous-batching engine.

A bounded window of requests sits inside the engine (`window_factor` × max_num_seqs, waiting
plus running) and is topped up as requests finish: the scheduler always has a full batch to
pick from, while a million-line file is never tokenized into memory at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm import LLM
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.sequence import Sequence
from tokenmill.jobs.output import new_id
from tokenmill.jobs.runner import BackendStats, ResultSink, StopFlag
from tokenmill.jobs.spec import CHAT_URL, DEFAULT_MAX_TOKENS, BatchRequest
from tokenmill.models.loader import default_model_path

# Body fields that change what the caller gets back; refusing beats silently ignoring them.
UNSUPPORTED_FIELDS = (
    "tools", "tool_choice", "functions", "function_call", "response_format", "logprobs", "top_logprobs",
    "logit_bias", "echo", "suffix", "best_of", "stream", "presence_penalty", "frequency_penalty",
)


class EmbeddedBackend:
    kind = "embedded"

    def __init__(
        self, model: str | None = None, *, llm: LLM | None = None, max_num_seqs: int = 64,
        window_factor: int = 2, **engine_config: Any,
    ) -> None:
        """`llm`: an engine already built (tests share one model load); else built in `start`."""
        self._model_arg = model
        self._llm = llm
        self._engine_config = {"max_num_seqs": max_num_seqs, **engine_config}
        num_seqs = llm.engine.config.max_num_seqs if llm else max_num_seqs
        self.window = max(1, window_factor * num_seqs)
        self.model = model_name(model if model is not None or llm is None else llm.engine.config.model)

    # ---- validation (before any work) -------------------------------------------------------
    def check(self, request: BatchRequest) -> None:
        body = request.body
        for name in UNSUPPORTED_FIELDS:
            if body.get(name) not in (None, False, 0, [], {}):
                raise ValueError(f"body.{name} is not supported by the embedded engine")
        if body.get("n", 1) != 1:
            raise ValueError(f"body.n = {body['n']}: the embedded engine returns one choice per request")
        if request.url == CHAT_URL:
            _chat_messages(body["messages"])
        sampling_params(body)

    # ---- running ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._llm is None:
            self._llm = LLM(self._model_arg, **self._engine_config)

    def run(self, requests: Iterator[BatchRequest], sink: ResultSink, stop: StopFlag) -> BackendStats:
        assert self._llm is not None, "start() first"
        engine = self._llm.engine
        stats, timer = engine.scheduler.stats, _StepTimer()
        preemptions0 = stats.num_preemptions
        inflight: dict[str, tuple[BatchRequest, Sequence]] = {}
        exhausted = False
        while True:
            if stop.requested:
                self._abort(inflight, everything=stop.forced)
            elif not exhausted:
                exhausted = self._top_up(requests, inflight, sink)
            if not inflight:
                break
            for out in timer.step(engine):
                if out.finished and out.request_id in inflight:
                    request, _ = inflight.pop(out.request_id)
                    sink.result(request, self._response_body(request, out))
        return BackendStats(
            prefill_tokens=timer.prefill_tokens, decode_tokens=timer.decode_tokens,
            prefill_s=timer.prefill_s, decode_s=timer.decode_s,
            num_preemptions=stats.num_preemptions - preemptions0,
        )

    def share_machine(self, share: float) -> None:
        """Before `start`: this engine runs beside others on one machine (Ray replicas) and gets
        `share` (0–1] of it, so its KV cache takes that part of the memory-fraction budget instead
        of each engine taking the whole fraction of the memory free when it starts."""
        if not any(k in self._engine_config for k in ("kv_cache_bytes", "num_kv_blocks")):
            fraction = self._engine_config.get("kv_cache_memory_fraction", EngineConfig.kv_cache_memory_fraction)
            self._engine_config["kv_cache_memory_fraction"] = fraction * min(1.0, share)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop these requests from the engine, e.g. after `run` raised half-way through them."""
        if self._llm is not None:
            for request_id in request_ids:
                self._llm.engine.abort_request(request_id)

    def _top_up(
        self, requests: Iterator[BatchRequest], inflight: dict[str, tuple[BatchRequest, Sequence]], sink: ResultSink
    ) -> bool:
        """Fill the window; returns True once `requests` is exhausted."""
        assert self._llm is not None
        engine = self._llm.engine
        while len(inflight) < self.window:
            request = next(requests, None)
            if request is None:
                return True
            try:
                seq = engine.make_sequence(self._prompt(request), sampling_params(request.body), request.custom_id)
            except (ValueError, TypeError, TemplateError) as exc:  # e.g. longer than the context
                sink.error(request, "invalid_request", f"{type(exc).__name__}: {exc}"
                           if not isinstance(exc, ValueError) else str(exc))
                continue
            engine.add_sequence(seq)
            inflight[request.custom_id] = (request, seq)
        return False

    def _abort(self, inflight: dict[str, tuple[BatchRequest, Sequence]], everything: bool) -> None:
        """Stop: drop what has not started (or everything, on a second signal); not written, so
        a re-run does them. Requests already computing run to the end."""
        assert self._llm is not None
        for request_id, (_, seq) in list(inflight.items()):
            if everything or seq.timings.scheduled is None:
                self._llm.engine.abort_request(request_id)
                del inflight[request_id]

    def _prompt(self, request: BatchRequest) -> Any:
        assert self._llm is not None
        if request.url == CHAT_URL:
            return {"prompt_token_ids": self._llm.chat_token_ids(_chat_messages(request.body["messages"]))}
        return request.body["prompt"]

    def _response_body(self, request: BatchRequest, out: RequestOutput) -> dict[str, Any]:
        usage = {
            "prompt_tokens": out.num_prompt_tokens,
            "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        }
        if request.url == CHAT_URL:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": out.finish_reason}
            kind, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            kind, prefix = "text_completion", "cmpl-"
        return {"id": new_id(prefix), "object": kind, "created": int(time.time()), "model": self.model,
                "choices": [choice], "usage": usage}


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """OpenAI (and vLLM's extra) body fields → SamplingParams; ValueError names the body field."""
    stop = body.get("stop") or []
    top_k = body.get("top_k", 0)
    try:
        return SamplingParams(
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS,
            min_tokens=body.get("min_tokens", 0),
            temperature=float(body.get("temperature", 1.0)),  # OpenAI's default
            top_p=float(body.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" -1
            seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop_token_ids=list(body.get("stop_token_ids") or []),
            stop=[stop] if isinstance(stop, str) else list(stop),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc).replace("SamplingParams.", "body.")) from None


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages with string content (text parts joined); other parts are refused."""
    plain = []
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"body.messages[{i}]: only text content parts are supported by the embedded engine")
            content = "".join(str(p.get("text", "")) for p in content)
        plain.append({"role": message["role"], "content": content})
    return plain


def model_name(model: str | None) -> str:
    """What results say they were generated with: the file name or hub id."""
    if model is None:
        try:
            return default_model_path().stem
        except FileNotFoundError:
            return "embedded-default"
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model)


class _StepTimer:
    """Runs engine steps and splits their time into prefill and decode (see summary.py)."""

    def __init__(self) -> None:
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0

    def step(self, engine: Any) -> list[RequestOutput]:
        stats = engine.scheduler.stats
        prefill0, decode0 = stats.prefill_tokens, stats.decode_tokens
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        prefill, decode = stats.prefill_tokens - prefill0, stats.decode_tokens - decode0
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        # A step that does both counts in both: each rate is "tokens of that kind per second of
        # the steps that computed any", so mixed steps make both rates lower bounds.
        if prefill:
            self.prefill_s += elapsed
        if decode:
            self.decode_s += elapsed
        return outputs
