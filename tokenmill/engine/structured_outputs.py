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
from urllib.parse import unquote

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

    error = llguidance.LLMatcher.validate_grammar(grammar) or _endless(so)
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


# ---- schemas no finite value satisfies ------------------------------------------------------------
# llguidance refuses most unsatisfiable schemas itself ("Unsatisfiable schema: ..."), but compiles one
# whose $refs only lead back to themselves: the answer is then "" with "stop", as if it were
# complete, or a cut one with "error". So a schema is also checked here, by a least fixpoint: a node
# is satisfiable once what it needs (its clauses) is. The clauses are necessary conditions only, so
# the check may miss an unsatisfiable schema but never refuses one that some value satisfies.
Clause = list[list[Any]]  # alternatives, each the subschemas a value must all satisfy
SHAPED_TYPES = ("object", "array")  # the types whose values hold values: the others need nothing here


def _endless(so: StructuredOutputsParams) -> str | None:
    """Why no finite value satisfies the setting's JSON schema, or None (also for other kinds)."""
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return None  # llguidance's to refuse
    if not isinstance(schema, dict) or _rebases(schema):
        return None
    order, clauses = _reachable(schema)
    satisfiable = _least_fixpoint(order, clauses)
    if id(schema) in satisfiable:
        return None
    ref = next((n["$ref"] for n in order if id(n) not in satisfiable and isinstance(n.get("$ref"), str)), None)
    return "Unsatisfiable schema: no finite value satisfies it" + (
        f" ($ref {json.dumps(ref)} refers only back to itself)" if ref is not None else "")


def _rebases(schema: dict[str, Any]) -> bool:
    """Does anything below the root set its own base URI ($id, or draft 4's id)? Then "#" there is
    not the root, so no $ref is followed (a value in `examples` counts too: that only skips the check)."""
    stack: list[Any] = [*schema.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("$id"), str) or isinstance(value.get("id"), str):
                return True
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def _reachable(root: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[int, list[Clause]]]:
    """The object nodes the root's clauses lead to, children before parents (so a schema without
    cycles settles in one pass), and each one's clauses."""
    clauses = {id(root): _clauses(root, root)}
    order: list[dict[str, Any]] = []
    stack = [(root, iter(_subschemas(clauses[id(root)])))]
    while stack:
        children = stack[-1][1]
        child = next((c for c in children if isinstance(c, dict) and id(c) not in clauses), None)
        if child is None:
            order.append(stack.pop()[0])
        else:
            clauses[id(child)] = _clauses(child, root)
            stack.append((child, iter(_subschemas(clauses[id(child)]))))
    return order, clauses


def _subschemas(clauses: list[Clause]) -> list[Any]:
    return [schema for clause in clauses for alternative in clause for schema in alternative]


def _least_fixpoint(order: list[dict[str, Any]], clauses: dict[int, list[Clause]]) -> set[int]:
    """The ids of the nodes some finite value satisfies."""
    satisfiable: set[int] = set()

    def holds(schema: Any) -> bool:  # anything but `false` or an object node not (yet) satisfiable
        return schema is not False and (not isinstance(schema, dict) or id(schema) in satisfiable)

    grew = True
    while grew:
        grew = False
        for node in order:
            if id(node) not in satisfiable and all(any(all(map(holds, alternative)) for alternative in clause)
                                                   for clause in clauses[id(node)]):
                satisfiable.add(id(node))
                grew = True
    return satisfiable


def _clauses(node: dict[str, Any], root: dict[str, Any]) -> list[Clause]:
    """What a value satisfying `node` needs: for each clause, every subschema of one of its alternatives."""
    if "const" in node or "enum" in node:
        return []  # the values are listed: llguidance checks them
    clauses: list[Clause] = []
    if isinstance(node.get("$ref"), str):
        clauses.append([[_resolve(node["$ref"], root)]])
    if isinstance(node.get("allOf"), list):
        clauses.extend([[part]] for part in node["allOf"])
    clauses.extend([[part] for part in node[key]] for key in ("anyOf", "oneOf") if isinstance(node.get(key), list))
    # properties, required, items, minItems only constrain objects and arrays: without a "type" that
    # rules the other types out, a string satisfies them
    types = [node["type"]] if isinstance(node.get("type"), str) else node.get("type")
    if isinstance(types, list) and types and all(t in SHAPED_TYPES for t in types):
        clauses.append([_object_needs(node) if t == "object" else _array_needs(node) for t in types])
    return clauses


def _object_needs(node: dict[str, Any]) -> list[Any]:
    """The schemas of its required properties."""
    required = node.get("required")
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    needs = []
    for name in required if isinstance(required, list) else []:
        if isinstance(name, str) and name in properties:
            needs.append(properties[name])
        elif isinstance(name, str) and not node.get("patternProperties"):  # a pattern may take it: not followed
            needs.append(node.get("additionalProperties", True))
    return needs


def _array_needs(node: dict[str, Any]) -> list[Any]:
    """The schemas of its first minItems items: prefixItems then items (draft 7: items then additionalItems)."""
    count = node.get("minItems", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return []
    prefix, rest = node.get("prefixItems"), node.get("items", True)
    if not isinstance(prefix, list):
        prefix, rest = (rest, node.get("additionalItems", True)) if isinstance(rest, list) else ([], rest)
    return prefix[:count] + ([rest] if count > len(prefix) else [])


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    """The schema a local $ref ("#", "#/$defs/x", any JSON pointer) names; `true` (nothing followed)
    for the rest: an anchor, another document, a pointer to nothing (llguidance refuses that)."""
    pointer = unquote(ref[1:]) if ref.startswith("#") else None
    if pointer is None or (pointer and not pointer.startswith("/")):
        return True
    node: Any = root
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return True
    return node


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

    def check(self, so: StructuredOutputsParams) -> None:
        """Compile `so` now (`matcher` then copies the compile); the ValueError of `matcher`."""
        self.matcher(so)

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
        error = matcher.get_error() if matcher.is_error() else _endless(so)
        return _refusal(so, error) if error else matcher

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


def allowed_tokens_bitmask(matchers: list[tuple[llguidance.LLMatcher, int, list[int]]], rows: int,
                           vocab_size: int) -> np.ndarray:
    """[rows, ceil(vocab/32)] int32 bitmask, bit t of a row set where token t is allowed: for each
    (matcher, row, drafts), its grammar's mask at `row` and, at the rows after it, its masks after
    each draft token in turn; other rows allow everything."""
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    import numpy as np

    bitmask = np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
    drafted = [entry for entry in matchers if entry[2]]
    plain = [(matcher, row) for matcher, row, drafts in matchers if not drafts]
    if drafted:
        _executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.ctypes.data, bitmask.shape[1] * 4, rows)
    if plain:
        _executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, bitmask.shape[1] * 4, rows)
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
