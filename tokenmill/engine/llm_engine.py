"""The engine loop: `add_request`, `step`, `abort_request`, the stop rules, and the counters
callers read (`stats`, `metrics`). The offline `LLM` API drives it from engine/llm.py."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from tokenmill.engine.block_manager import BlockManager
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.interface import (
    EngineCapabilities,
    EngineRequest,
    FinishReason,
    RequestOutput,
    RequestTimings,
    SchedulerMetrics,
    SchedulerStats,
    TokenLogprob,
)
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.processor import InputProcessor
from tokenmill.engine.prompt import Prompt
from tokenmill.engine.sampler import SamplerOutput
from tokenmill.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.speculative import Drafter, accepted_prefix, speculative_settings
from tokenmill.engine.structured_outputs import GrammarCompiler
from tokenmill.models import kernels, quant
from tokenmill.models.build import build_model, free_memory, weight_bytes
from tokenmill.models.config import ModelConfig
from tokenmill.models.loader import LoadedWeights, load_weights

log = logging.getLogger(__name__)


class LLMEngine:
    name = "embedded"

    def __init__(self, config: EngineConfig, weights: LoadedWeights | None = None) -> None:
        """`weights`: already loaded weights to reuse (several engines over one model)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.resolved_device()
        self.weight_format = self._resolve_weight_format()
        weights = weights or load_weights(config.model, config.tokenizer, config.torch_dtype, self.weight_format)
        self.model_config = weights.config
        self.tokenizer = weights.tokenizer
        self.max_model_len = self._resolve_max_model_len(weights.config)
        self.kv_dtype = config.kv_torch_dtype(kernels.supports(self.device, config.torch_dtype))
        model = build_model(
            weights, self.max_model_len, self.device, config.torch_dtype,
            pack_weights=config.pack_weights, batch_hint=config.max_num_batched_tokens,
            small_batch_kernel=self._use_small_batch_kernel(weights), weight_format=self.weight_format,
        )
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.eos_token_ids = self._eos_token_ids()
        self.processor = InputProcessor(self.tokenizer, self.max_model_len, self.model_config.vocab_size)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                        config.grammar_compile_timeout_s)
        # The compiler's method, not this engine's: a bound method of the engine would make a
        # reference cycle, and the engine (its weights, its KV cache) must go with its last reference.
        self.capabilities = EngineCapabilities(check_structured_outputs=self.grammars.check)
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, self.eos_token_ids, self.device,
            paged_kernel=self._kernel_wanted("decode_attention", fallback="sdpa", reads_kv=True),
            prefill_kernel=self._kernel_wanted("prefill_attention", fallback="sdpa", reads_kv=True),
            kv_dtype=self.kv_dtype,
        )
        settings = speculative_settings(config.speculative)
        self.drafter = None if settings is None else Drafter(settings, self.max_model_len)
        self._requests: dict[str, tuple[Sequence, IncrementalDetokenizer]] = {}
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(config.seed)

    # ---- setup ----------------------------------------------------------------------------
    def _resolve_max_model_len(self, cfg: ModelConfig) -> int:
        max_len = self.config.max_model_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_len} exceeds the model's context of {cfg.max_position_embeddings}"
            )
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < max_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.config.max_num_batched_tokens})"
                f" must be >= max_model_len ({max_len}) or long prompts could never be scheduled"
            )
        return max_len

    def _resolve_weight_format(self) -> str:
        """EngineConfig.weight_format, with auto settled: quantised only where the kernels run."""
        choice = self.config.weight_format
        usable = kernels.supports(self.device, self.config.torch_dtype) and quant.kernel_available()
        if choice in ("q8", "q4") and not usable:
            raise ValueError(f"EngineConfig.weight_format={choice!r} needs a CPU with AVX2, float32 and a C compiler "
                             "(see the log for why the kernels did not build); use 'auto' or 'fp32'")
        return choice if choice != "auto" or usable else "fp32"

    def _kernel_wanted(self, setting: str, fallback: str, reads_kv: bool = False) -> bool:
        """A C-kernel setting ("auto" | "kernel" | its PyTorch `fallback`): use the kernel? `reads_kv`: an
        attention kernel, which reads fp32 and fp16 caches only."""
        choice = getattr(self.config, setting)
        if choice == fallback:
            return False
        usable = kernels.supports(self.device, self.config.torch_dtype)
        if reads_kv:
            usable = usable and self.kv_dtype in kernels.KERNEL_KV_DTYPES
        if choice == "kernel" and not usable:
            cache = ", a float32 or float16 KV cache" if reads_kv else ""
            raise ValueError(
                f"EngineConfig.{setting}='kernel' needs a CPU, float32{cache} and a C compiler "
                f"(see the log for why it did not build); use 'auto' or {fallback!r}"
            )
        return usable

    def _use_small_batch_kernel(self, weights: LoadedWeights) -> bool:
        if not self._kernel_wanted("small_batch_linear", fallback="off"):
            return False
        if self.config.small_batch_linear == "auto":
            # The kernel keeps its own copy of the weights: about the model's size once more.
            copy_bytes = weight_bytes(weights, self.config.torch_dtype)
            if copy_bytes > free_memory(self.device) // 4:
                log.info("small-batch linear kernel off: a %.0f MiB weight copy is over a quarter of free "
                         "memory", copy_bytes / 2**20)
                return False
        return True

    def _num_kv_blocks(self) -> int:
        cfg, bs = self.config, self.config.block_size
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        dtype_bytes = self.kv_dtype.itemsize
        block_bytes = self.model_config.kv_bytes_per_token(dtype_bytes) * bs
        budget = cfg.kv_cache_bytes or int(cfg.kv_cache_memory_fraction * free_memory(self.device))
        # More than every running sequence at full length would never be used.
        useful = cfg.max_num_seqs * -(-self.max_model_len // bs)
        blocks = min(budget // block_bytes, useful)
        if blocks < 1:
            raise ValueError(f"KV-cache budget of {budget} bytes holds no {block_bytes}-byte block")
        log.info("KV cache: %d blocks of %d tokens, %s (%.1f MiB)", blocks, bs,
                 str(self.kv_dtype).removeprefix("torch."), blocks * block_bytes / 2**20)
        return int(blocks)

    def _eos_token_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    # ---- requests -------------------------------------------------------------------------
    def check_prompt_chars(self, num_chars: int) -> None:
        self.processor.check_prompt_chars(num_chars)

    def check_structured_outputs(self, structured_outputs: StructuredOutputsParams) -> None:
        """Compile the setting (once per distinct setting; `process_request` reuses it). Raises
        ValueError("structured_outputs.<kind>: why") for a schema, regex or grammar that does not
        compile, or not within `grammar_compile_timeout_s`."""
        self.grammars.check(structured_outputs)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def process_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        """Validate and tokenize (`InputProcessor`), then what only this engine checks: the KV cache
        holds the request, its structured output compiles. Raises ValueError naming the problem and
        changes no state: safe off the engine's thread."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = self.processor.process(prompt, params, request_id, priority)
        self._check_kv_cache_holds(request)
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)  # refused here, not when added
        return request

    def _check_kv_cache_holds(self, request: EngineRequest) -> None:
        most_tokens = min(len(request.prompt_token_ids) + request.params.max_tokens, self.max_model_len)
        needed = self.block_manager.blocks_for_tokens(most_tokens)
        if needed > self.block_manager.num_blocks:
            raise ValueError(
                f"request needs up to {needed} KV-cache blocks ({most_tokens} tokens) but the cache "
                f"has only {self.block_manager.num_blocks}; lower max_tokens or enlarge the cache"
            )

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate, tokenize and queue a request (lower `priority` first under the "priority"
        policy); returns its id. ValueError names what is wrong and nothing is queued."""
        return self.add_processed(self.process_request(prompt, params, request_id, priority))

    def add_processed(self, request: EngineRequest) -> str:
        """Queue a processed request. Its grammar matcher is a fresh copy of the compile that
        `process_request` cached; an unseeded request's seed is drawn here, from the engine's own
        generator, on the one thread that steps the engine."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        so = request.params.structured_outputs
        matcher = None if so is None else self.grammars.matcher(so)
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        seq = Sequence(
            request.request_id, request.prompt_token_ids, request.params, prompt=request.prompt,
            priority=request.priority, seed=seed,
            timings=RequestTimings(request.arrival), matcher=matcher,
        )
        self._requests[seq.request_id] = (seq, IncrementalDetokenizer(self.tokenizer))
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        entry = self._requests.get(request_id)
        if entry is None:
            return None
        self.scheduler.finish(entry[0], FinishReason.ABORT)
        self._forget(entry[0])
        return self._output(entry[0])

    def has_started(self, request_id: str) -> bool:
        """Has any of this request's tokens been scheduled yet? (False once it has finished.)"""
        entry = self._requests.get(request_id)
        return entry is not None and entry[0].timings.scheduled is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- what callers may read and set ---------------------------------------------------------
    def stats(self) -> SchedulerStats:
        """A copy of the cumulative counters (tokens prefilled and decoded, preemptions, prefix
        cache): take one before and one after some work and subtract."""
        return dataclasses.replace(self.scheduler.stats)

    def metrics(self) -> SchedulerMetrics:
        """Running and waiting counts, KV-cache usage and the counters, as one snapshot that is
        safe to read on another thread."""
        return self.scheduler.metrics()

    @property
    def num_kv_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def model(self) -> str | None:
        return self.config.model

    def describe(self) -> dict[str, Any]:
        """Every setting, with what was derived from the model and the machine."""
        return {**dataclasses.asdict(self.config), "max_model_len_resolved": self.max_model_len,
                "num_kv_blocks": self.num_kv_blocks, "weight_format_resolved": self.weight_format,
                "device_resolved": str(self.device)}

    def close(self) -> None:
        """Nothing to stop: the engine lives in this process and goes with its last reference."""

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """Cap the running batch at or below `config.max_num_seqs` (the KV cache was sized for
        that), so one engine can be measured at several batch sizes."""
        if not 1 <= max_num_seqs <= self.config.max_num_seqs:
            raise ValueError(
                f"max_num_seqs must be in [1, {self.config.max_num_seqs}] (the engine was built for "
                f"{self.config.max_num_seqs}), got {max_num_seqs}"
            )
        self.scheduler.max_num_seqs = max_num_seqs

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Propose drafts, schedule, run the model once, sample and verify; returns the requests that
        got one token or more."""
        started = time.perf_counter()
        if self.drafter is not None:
            self.drafter.propose([seq for seq in self.scheduler.running if not seq.in_prefill])
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        sampled = self.runner.execute(out.scheduled)
        produced = self._verify(out, sampled)
        self.scheduler.on_step_computed(out, [len(tokens) - 1 for _, tokens, _ in produced])
        outputs = []
        for item, tokens, logprobs in produced:
            seq = item.seq
            if self.drafter is not None:
                self.drafter.verified(seq, item.num_drafts, len(tokens) - 1)
            if not tokens:
                continue
            for token, logprob in zip(tokens, logprobs, strict=True):
                self._append_token(seq, token, logprob)
                if seq.is_finished:
                    break
            outputs.append(self._output(seq))
            if seq.is_finished:
                self._forget(seq)
        # Only decode steps teach the draft budget what a step costs: a prefill token is cheaper
        # than a row that is attended and sampled, so mixed steps would make drafts look cheap.
        if self.drafter is not None and (decode_tokens := out.decode_tokens) is not None:
            self.drafter.budget.observe(decode_tokens, time.perf_counter() - started)
        return outputs

    @staticmethod
    def _verify(out: SchedulerOutput, sampled: SamplerOutput) -> list[tuple[ScheduledSequence, list[int], list]]:
        """Each scheduled item with the tokens it produced (none: a prefill chunk that samples
        nothing) and their logprobs: one sampled token, or a draft's verified prefix and the next."""
        produced = []
        row = 0
        for item in out.scheduled:
            if not item.samples:
                produced.append((item, [], []))
                continue
            rows = slice(row, row + 1 + item.num_drafts)
            row = rows.stop
            tokens = accepted_prefix(item.seq.draft_token_ids, sampled.token_ids[rows])
            produced.append((item, tokens, sampled.logprobs[rows][: len(tokens)]))
        return produced

    def _forget(self, seq: Sequence) -> None:
        del self._requests[seq.request_id]
        if self.drafter is not None:
            self.drafter.finished(seq)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)  # one per output token, never trimmed: a stop string cuts only text
        if seq.timings.first_token is None:
            seq.timings.first_token = time.monotonic()
        detok = self._requests[seq.request_id][1]
        old_len = len(detok.text)
        detok.add(token)
        seq.output_text = detok.text
        reason = self._stop_reason(seq, token, old_len)
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token: int, old_text_len: int) -> FinishReason | None:
        p = seq.params
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed it: this would be a bug
                seq.error = f"structured_outputs: the grammar refused token {token}: {seq.matcher.get_error()}"
                return FinishReason.ERROR
            if seq.matcher.is_stopped():  # complete: nothing but the end may follow
                return FinishReason.STOP
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return FinishReason.STOP
            if p.stop and self._truncate_at_stop_string(seq, old_text_len):
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence, old_text_len: int) -> bool:
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, old_text_len - longest + 1)  # a stop string may straddle the new text
        hits = [(i, s) for s in seq.params.stop if (i := seq.output_text.find(s, start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.output_text = seq.output_text[:index]
        seq.stop_reason = stop
        return True

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            timings=seq.timings,
            finished=seq.is_finished,
            error=seq.error,
            # A copy: the output may be read on another thread while the sequence goes on growing.
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
        )

