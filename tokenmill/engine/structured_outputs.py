"""Structured outputs: grammars compiled by llguidance, and the token mask they put on each step.

Each distinct setting (a JSON schema, a choice list, a regex, a grammar) is compiled once into a
pristine matcher; every request gets a copy of it (microseconds), so a job that sends one schema
with 100,000 rows compiles it once. Compiling runs under a time limit on a worker thread (and
under llguidance's own work limits), so a pathological schema fails its request, not the engine.

A request's matcher advances by the tokens it samples. It lives on the request, so preemption by
recompute (which recomputes KV for tokens already known) leaves it exactly where it was.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tokenmill.engine.sampling_params import StructuredOutputsParams

# llguidance, numpy and torch are imported where they are used: `check_grammar` runs while flags are
# read, and the commands that only read flags or call an endpoint never import torch
if TYPE_CHECKING:
    import llguidance
    import numpy as np
    import torch
    from llguidance._lib import JsonCompileOptions

# Compact JSON, no optional whitespace: an answer takes the fewest tokens and a model cannot spend
# its max_tokens on blank lines. A schema's own "x-guidance" options still override this.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
COMPILED_CACHE_SIZE = 256  # distinct settings kept compiled (a job usually has one)


def grammar_text(so: StructuredOutputsParams, tokenizer: Any = None) -> str:
    """The setting as an llguidance grammar (not yet checked). With the model's `tokenizer`, a choice
    is its labels' own token sequences: each label costs one step per token, in the spelling the
    model was trained on (any spelling, e.g. "i|n|form|ative" for "inform|ative", costs more steps
    and reads worse to the model)."""
    import llguidance

    kind = so.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(so.json, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "choice" and tokenizer is not None:
        spellings = ["".join(f"<[{t}]>" for t in tokenizer.encode(label, add_special_tokens=False))
                     for label in so.choice]  # type: ignore[union-attr]
        return llguidance.grammar_from("lark", "start: " + " | ".join(spellings))
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)  # type: ignore[arg-type]
    return llguidance.grammar_from("grammar", so.grammar)  # type: ignore[arg-type]


def check_grammar(so: StructuredOutputsParams) -> None:
    """Does the setting compile at all (no tokenizer needed)? ValueError("structured_outputs.<kind>:
    why") if not: lets a command refuse a bad flag before it loads a model or starts a job."""
    try:
        grammar = grammar_text(so)
    except ValueError as exc:
        raise ValueError(_refusal(so, str(exc))) from None
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(_refusal(so, error))


def _refusal(so: StructuredOutputsParams, message: str) -> str:
    """`structured_outputs.<kind>: why`, the form every caller maps to its own field or flag."""
    return f"structured_outputs.{so.kind}: {_readable(message)}"


def _readable(message: str) -> str:
    """llguidance's message on one line, without the grammar it wrapped a regex in (`1 | start: /…/`)
    and the carets under it."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and line.strip("^ ") and not re.match(r"\d+ \| ", line)]
    return " ".join(kept)


class GrammarCompiler:
    """Compiles settings into matchers for one tokenizer; thread-safe (requests are processed on
    the server's tokenizer threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], timeout_s: float) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self.timeout_s = timeout_s
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles run here so a slow one can be timed out; two, so one stuck compile does not
        # hold up the next request's.
        self._workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    def matcher(self, so: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for `so`. ValueError("structured_outputs.<kind>: why") when it does not
        compile (or not within the time limit); a failure is remembered like a success."""
        key = so.key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
        if compiled is None:
            compiled = self._compile(so)
            with self._lock:
                self._compiled[key] = compiled
                if len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, str):
            raise ValueError(compiled)
        return compiled.deep_copy()

    def _compile(self, so: StructuredOutputsParams) -> llguidance.LLMatcher | str:
        """The pristine matcher, or the error message."""
        tokenizer = self.ll_tokenizer()
        future = self._workers.submit(self._build, tokenizer, self._hf_tokenizer, so)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # The worker finishes in the background, within llguidance's own work limits.
            return _refusal(so, f"compiling it took longer than {self.timeout_s:g} s (grammar_compile_timeout_s); "
                                "simplify it")

    @staticmethod
    def _build(tokenizer: llguidance.LLTokenizer, hf_tokenizer: Any,
               so: StructuredOutputsParams) -> llguidance.LLMatcher | str:
        try:
            grammar = grammar_text(so, hf_tokenizer)
        except ValueError as exc:
            return _refusal(so, str(exc))
        import llguidance

        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return _refusal(so, matcher.get_error())
        return matcher

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer, built on first use (about a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs: this tokenizer cannot be used ({exc})") from None
            return self._ll_tokenizer


# ---- the per-step mask ----------------------------------------------------------------------------
_executor: llguidance.LLExecutor | None = None


def allowed_tokens_bitmask(matchers: list[tuple[llguidance.LLMatcher, int]], rows: int, vocab_size: int) -> np.ndarray:
    """[rows, ceil(vocab/32)] int32 bitmask, bit t of a row set where token t is allowed: rows named
    in `matchers` (matcher, row) get their grammar's mask, the others allow everything."""
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    import numpy as np

    bitmask = np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
    _executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, bitmask.shape[1] * 4, rows)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """Set the logits of disallowed tokens to -inf, in place: the C kernel where it built, else numpy
    and PyTorch (benchmarks/structured.py measures both, and llguidance's own helpers)."""
    import torch

    from tokenmill.models import kernels

    rows, vocab = logits.shape
    lib = kernels.library() if logits.dtype == torch.float32 and logits.is_contiguous() else None
    if lib is not None:
        lib.apply_token_bitmask(ctypes.c_void_p(logits.data_ptr()), ctypes.c_void_p(bitmask.ctypes.data),
                                rows, vocab, bitmask.shape[1])
    else:
        apply_bitmask_unpacked(logits, bitmask)


def apply_bitmask_unpacked(logits: torch.Tensor, bitmask: np.ndarray) -> None:
    """The same with PyTorch and numpy only."""
    import numpy as np
    import torch

    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    disallowed = torch.from_numpy(allowed.view(np.bool_)).logical_not_()
    logits.masked_fill_(disallowed, float("-inf"))
