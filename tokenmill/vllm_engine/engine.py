"""vLLM's engine, in this process, behind the interface jobs, bench and the server drive the
embedded one by (`StepEngine`, engine/interface.py).

`VllmEngine` steps `vllm.LLMEngine` and hands back tokenmill's `RequestOutput`s, so the batch
job's backend (its window, abort on stop, exactly-once writing), the benchmark's timing code and
the server's engine loop run unchanged on it. What it adds on top of vLLM:
- a queue of its own: at most `max_num_seqs` requests are inside vLLM at once, so a job's
  window can be larger and a benchmark can cap the batch per run without restarting vLLM
  (whose own max_num_seqs is fixed when it starts);
- the counters the job summary and benchmark read (tokens prefilled and decoded), counted from
  the outputs: prefill = prompt tokens not served from vLLM's prefix cache, decode = every
  output token after the first; preemptions are vLLM's own counter (`vllm:num_preemptions`,
  kept while its stats are on, as they are unless `disable_log_stats` is set).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine import (
    EngineCapabilities,
    EngineConfig,
    EngineRequest,
    FinishReason,
    InputProcessor,
    Prompt,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    SchedulerMetrics,
    SchedulerStats,
    TokenLogprob,
    chat_prompt_ids,
)
from tokenmill.models.build import free_memory
from tokenmill.models.export import hf_folder_for
from tokenmill.vllm_engine.config import INSTALL_HINT, VllmConfig
from tokenmill.vllm_engine.lifeline import tie_engine_processes_to_this_one

PREEMPTIONS_READ_EVERY_S = 1.0


def import_vllm() -> Any:
    try:
        import vllm  # type: ignore[import-not-found]  # optional: tokenmill[vllm]
    except ImportError as exc:
        raise ValueError(f"{INSTALL_HINT} ({exc})") from None
    return vllm


def _refusal_types() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it will not take (a grammar that does not compile, ...)."""
    try:
        from vllm.exceptions import VLLMClientError  # type: ignore[import-not-found]
    except ImportError:  # older vLLM: ValueError
        return (ValueError, TypeError)
    return (ValueError, TypeError, VLLMClientError)


def set_cpu_defaults() -> bool:
    """On a machine without a GPU (returns True there), vLLM's CPU build keeps a core for its front
    end and binds its threads its own way; a batch job wants every core on the model. Settings
    already in the environment win. LD_PRELOAD reaches vLLM's engine process, which starts after
    this (spawn); its Intel OpenMP runtime is what that build is tuned with."""
    if torch.cuda.is_available():
        return False
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    preload = os.environ.get("LD_PRELOAD", "")
    if iomp.is_file() and "libiomp5" not in preload:
        os.environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else str(iomp)
    return True


def with_cpu_kv_budget(engine_args: dict[str, Any]) -> dict[str, Any]:
    """vLLM's arguments on a CPU: without a KV budget of the user's, vLLM's cache gets the embedded
    engine's default share of free memory (vLLM would take 92% of the machine's, its GPU default)."""
    if {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(engine_args):
        return engine_args
    fraction = EngineConfig.kv_cache_memory_fraction
    return {**engine_args, "kv_cache_memory_bytes": int(fraction * free_memory(torch.device("cpu")))}


@dataclass
class _Request:
    """One request while tokenmill holds it: queued here, then inside vLLM."""

    request_id: str
    text: str | None  # the prompt as text, where it came as text
    prompt_token_ids: list[int]
    params: Any  # vllm.SamplingParams
    priority: int
    timings: RequestTimings
    submitted: bool = False
    text_so_far: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per output token, where params.logprobs asks

    def output(self, finish_reason: FinishReason | None, stop_reason: int | str | None = None) -> RequestOutput:
        """tokenmill's output for where the request stands. vLLM's outputs do not say how often a
        request was preempted (its counter is the engine's: `stats()`), so neither does this."""
        return RequestOutput(
            request_id=self.request_id, prompt=self.text, prompt_token_ids=self.prompt_token_ids,
            text=self.text_so_far, token_ids=list(self.token_ids), finish_reason=finish_reason,
            stop_reason=stop_reason, num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens, num_preemptions=None, timings=self.timings,
            finished=finish_reason is not None, logprobs=None if self.logprobs is None else list(self.logprobs),
        )


class VllmEngine:
    """`StepEngine` (engine/interface.py) over `vllm.LLMEngine`."""

    name = "vllm"
    capabilities = EngineCapabilities()  # vLLM compiles a structured output when the request is submitted

    def __init__(self, config: VllmConfig) -> None:
        """`config.vllm_engine_args()` go to vllm.EngineArgs as they are; on a CPU without a KV
        budget of the user's, vLLM's cache gets the embedded engine's default budget (vLLM would
        take 92% of the machine's memory, its GPU default)."""
        on_cpu = set_cpu_defaults()
        vllm = import_vllm()
        self.config = config
        self.model = config.model
        self.engine_args = {**config.vllm_engine_args(), "model": _vllm_model(config)}
        if on_cpu:
            self.engine_args = with_cpu_kv_budget(self.engine_args)
        self._vllm = vllm
        self._refusals = _refusal_types()
        tie_engine_processes_to_this_one()  # a kill -9 of this process takes vLLM's engine processes too
        self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**self.engine_args))
        vllm_config = self._engine.vllm_config
        self.tokenizer = self._engine.get_tokenizer()
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)  # what vLLM was built for
        # vLLM's own bound on a token id: the model's vocabulary or the tokenizer's, whichever is larger.
        vocab_size = max(vllm_config.model_config.get_vocab_size(), self.tokenizer.max_token_id + 1)
        self.processor = InputProcessor(self.tokenizer, self.max_model_len, vocab_size)
        self._batch_cap = self.max_num_seqs
        self._priority = vllm_config.scheduler_config.policy == "priority"
        self._requests: dict[str, _Request] = {}
        self._queue: deque[str] = deque()
        self._stats = SchedulerStats()
        self._preemptions_read_at = 0.0
        self._ids = 0

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._ids += 1
        return f"vllm-{self._ids}"

    def check_prompt_chars(self, num_chars: int) -> None:
        self.processor.check_prompt_chars(num_chars)

    def process_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                        priority: int = 0) -> EngineRequest:
        """Tokenize and check (any thread), as the embedded engine does (`InputProcessor`): refused
        now, not at submission. A structured output is compiled by vLLM when the request is
        submitted: one that does not compile comes back as that request's output with
        FinishReason.ERROR."""
        request_id = request_id if request_id is not None else self.new_request_id()
        return self.processor.process(prompt, params or SamplingParams(), request_id, priority)

    def add_processed(self, request: EngineRequest) -> str:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = _Request(
            request.request_id, request.prompt, list(request.prompt_token_ids), self._vllm_params(request.params),
            request.priority if self._priority else 0, RequestTimings(request.arrival),
            logprobs=None if request.params.logprobs is None else [])
        self._queue.append(request.request_id)
        return request.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        return self.add_processed(self.process_request(prompt, params, request_id, priority))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.submitted:
            self._engine.abort_request([request_id])
        else:
            self._queue.remove(request_id)
        request.timings.finished = time.monotonic()
        return request.output(FinishReason.ABORT)

    def has_started(self, request_id: str) -> bool:
        """Inside vLLM (which runs at most max_num_seqs of them, as tokenmill submits)."""
        request = self._requests.get(request_id)
        return request is not None and request.submitted

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        refused = self._submit()
        if not self._engine.has_unfinished_requests():
            return refused
        return refused + [out for raw in self._engine.step() if (out := self._output(raw)) is not None]

    # ---- what callers may read and set ---------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """The counters. vLLM's preemption counter is read when the engine is idle (the end of a
        run: exact there) or at most once a second: reading vLLM's metrics walks its whole
        Prometheus registry, which every step of a job or a benchmark would otherwise pay twice."""
        now = time.monotonic()
        if not self._requests or now - self._preemptions_read_at >= PREEMPTIONS_READ_EVERY_S:
            self._stats.num_preemptions = int(self._counter("vllm:num_preemptions"))
            self._preemptions_read_at = now
        return replace(self._stats)

    def metrics(self) -> SchedulerMetrics:
        running = sum(r.submitted for r in self._requests.values())
        return SchedulerMetrics(running, len(self._requests) - running,
                                self._counter("vllm:kv_cache_usage_perc"), self.stats())

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        if not 1 <= max_num_seqs <= self.max_num_seqs:
            raise ValueError(f"max_num_seqs must be in [1, {self.max_num_seqs}] (vLLM was started with "
                             f"{self.max_num_seqs}), got {max_num_seqs}")
        self._batch_cap = max_num_seqs

    def describe(self) -> dict[str, Any]:
        """The settings given (vLLM's argument names), and what vLLM resolved."""
        return {**{f"vllm_{k}": v for k, v in self.engine_args.items()}, "max_model_len_resolved": self.max_model_len,
                "max_num_seqs_resolved": self.max_num_seqs,
                "num_kv_blocks": int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)}

    def close(self) -> None:
        """Stop vLLM's engine process now rather than at garbage collection."""
        shutdown = getattr(getattr(self._engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- inside --------------------------------------------------------------------------------
    def _submit(self) -> list[RequestOutput]:
        """Move queued requests into vLLM up to the batch cap; those it refuses come back as errors."""
        refused = []
        inside = sum(r.submitted for r in self._requests.values())
        while self._queue and inside < self._batch_cap:
            request = self._requests[self._queue.popleft()]
            try:
                self._engine.add_request(request.request_id, {"prompt_token_ids": request.prompt_token_ids},
                                         request.params, priority=request.priority)
            except self._refusals as exc:
                del self._requests[request.request_id]
                refused.append(RequestOutput.refused(request.request_id, f"refused by vLLM: {exc}"))
                continue
            request.submitted = True
            request.timings.scheduled = time.monotonic()
            inside += 1
        return refused

    def _output(self, raw: Any) -> RequestOutput | None:
        request = self._requests.get(raw.request_id)
        if request is None:  # aborted meanwhile
            return None
        completion = raw.outputs[0]
        new_tokens = len(completion.token_ids) - len(request.token_ids)
        now = time.monotonic()
        if new_tokens > 0:
            if not request.token_ids:  # the step that computed the prompt
                request.num_cached_tokens = raw.num_cached_tokens or 0
                self._stats.prefill_tokens += len(request.prompt_token_ids) - request.num_cached_tokens
                self._stats.decode_tokens += new_tokens - 1
                request.timings.first_token = now
            else:
                self._stats.decode_tokens += new_tokens
        if request.logprobs is not None and completion.logprobs is not None:
            done = len(request.logprobs)  # vLLM's list is cumulative: convert only the new tokens
            request.logprobs += token_logprobs(completion.token_ids[done:], completion.logprobs[done:],
                                               request.params.logprobs)
        request.token_ids, request.text_so_far = list(completion.token_ids), completion.text
        if not raw.finished:
            return request.output(None)
        request.timings.finished = now
        del self._requests[raw.request_id]
        # vLLM's finish reasons as strings are tokenmill's (its "repetition" needs a detection that
        # `_vllm_params` never turns on).
        return request.output(FinishReason(completion.finish_reason), completion.stop_reason)

    def _vllm_params(self, params: SamplingParams) -> Any:
        """Every SamplingParams field under its own name, which is vLLM's too (an unseeded request
        takes vLLM's engine seed); lists copied, since vLLM keeps what it is given."""
        given = {f.name: copy.copy(getattr(params, f.name)) for f in fields(params)}
        so = given.pop("structured_outputs")
        structured = None if so is None else self._vllm.sampling_params.StructuredOutputsParams(
            **{so.kind: getattr(so, so.kind)})
        return self._vllm.SamplingParams(**given, structured_outputs=structured)

    def _counter(self, name: str) -> float:
        """One of vLLM's own metrics, where its stats are on (0 otherwise)."""
        if getattr(self._engine, "log_stats", False):
            for metric in self._engine.get_metrics():
                if metric.name == name:
                    return float(getattr(metric, "value", 0.0))
        return 0.0


def token_logprobs(token_ids: Sequence[int], positions: Iterable[Mapping[int, Any]], n: int) -> list[TokenLogprob]:
    """vLLM's logprobs of these output tokens ({token id: Logprob(logprob, rank, decoded_token)} per
    token: the sampled token's and the n ranked first) as TokenLogprobs. vLLM takes them from the raw
    logits (its default logprobs_mode), before any grammar mask: for a structured output they are
    the unconstrained model's, where the embedded engine's are over the allowed tokens."""
    found = []
    for token_id, position in zip(token_ids, positions, strict=True):
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in position.items() if lp.rank is not None and lp.rank <= n)
        found.append(TokenLogprob(token_id, position[token_id].logprob, tuple((t, v) for _, t, v in ranked[:n])))
    return found


def _vllm_model(config: VllmConfig) -> str:
    """What vLLM reads: an --engine-arg model as it is, else tokenmill's --model (a GGUF file
    exported once to a folder of safetensors)."""
    return str(config.engine_args.get("model") or hf_folder_for(config.model))


class VllmLLM:
    """`InProcessModel` (engine/interface.py) for vLLM: the engine, its tokenizer and
    conversations through the chat template."""

    def __init__(self, config: VllmConfig) -> None:
        self.engine = VllmEngine(config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def chat_token_ids(self, messages: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, template_kwargs)
