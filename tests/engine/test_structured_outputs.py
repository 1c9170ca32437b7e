"""Structured outputs in the engine: every answer that ends follows its grammar; greedy constrained
output equals a plain reference (contiguous KV, full recompute, the same mask applied by
llguidance's own code) on every cache path; refusals name the setting and why."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from tests.reference import Reference, ReferenceCache, assert_matches_reference
from tokenmill.engine import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.engine.structured_outputs import (
    allowed_tokens_bitmask,
    apply_bitmask,
    apply_bitmask_unpacked,
    check_grammar,
    grammar_text,
)
from tokenmill.models.loader import LoadedWeights, load_weights
from tokenmill.openai_compat import CHAT_URL, RequestError, check_structured_outputs, parse_request

# The confidence is a bounded integer: a JSON number has no bound on its digits, and SmolLM2 writes
# "0.9999…" until max_tokens.
LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "mixed"]},
        "summary": {"type": "string", "maxLength": 40},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["label", "summary", "confidence"],
    "additionalProperties": False,
}
# Hand-written schemas covering the keywords extraction jobs use.
SCHEMAS = [
    LABEL_SCHEMA,
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "email": {"type": "string", "maxLength": 30}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object",
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}},
                                      "paid": {"type": "boolean"}},
     "required": ["items", "paid"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "null"}, {"enum": ["yes", "no"]}]},
                                      "score": {"type": "number", "exclusiveMinimum": -1, "maximum": 1}},
     "required": ["answer", "score"], "additionalProperties": False},
]
MAX_NEW = 48


def conversation(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Label the review and answer in JSON with label, summary and confidence."},
            {"role": "user", "content": text}]


REVIEWS = ["Great product, love it.", "Broke after a day and support never answered.",
           "Good screen, but the battery dies by lunch.", "Fine.", "The best kettle I have owned, boils in a minute."]


# ---- the plain reference ---------------------------------------------------------------------------
@torch.inference_mode()
def reference_constrained(model: torch.nn.Module, tokenizer: llguidance.LLTokenizer, so: StructuredOutputsParams,
                          prompt: list[int], max_new: int) -> Reference:
    """Greedy with the whole context recomputed every step (no KV cache at all), masked by a fresh
    matcher through llguidance's own numpy code: shares nothing with the engine but the grammar."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(so))
    ids, tokens, logits_seen = list(prompt), [], []
    for _ in range(max_new):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy().copy()
        bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        llguidance.numpy.apply_token_bitmask_inplace(logits, bitmask)
        token = int(logits.argmax())
        tokens.append(token)
        logits_seen.append(torch.from_numpy(logits))
        ids.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return Reference(tokens, logits_seen)


@pytest.fixture(scope="module")
def ll_tokenizer(smollm_weights: LoadedWeights) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(smollm_weights.tokenizer, n_vocab=49152, eos_token=[2])


def _chat_ids(llm: LLM, texts: list[str]) -> list[list[int]]:
    return [llm.chat_token_ids(conversation(t)) for t in texts]


def _check(llm: LLM, free_ref: ReferenceCache, constrained_ref: Callable[[list[int]], Reference],
           prompts: list[list[int]], what: str) -> None:
    """Even-numbered prompts constrained, odd ones free, all in one batch."""
    so = StructuredOutputsParams(json=LABEL_SCHEMA)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, structured_outputs=so if i % 2 == 0 else None)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        if i % 2 == 0:
            ref = constrained_ref(prompt)
            assert_matches_reference(out.token_ids, ref, f"{what}: constrained prompt {i}")
            if out.token_ids == ref.tokens and out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), LABEL_SCHEMA)
        else:
            free = free_ref(prompt, len(out.token_ids))
            assert_matches_reference(out.token_ids, free, f"{what}: free prompt {i}")


@pytest.mark.slow
def test_greedy_constrained_output_matches_the_plain_reference_on_every_cache_path(
    smollm_weights: LoadedWeights, smollm_reference: torch.nn.Module, ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    so = StructuredOutputsParams(json=LABEL_SCHEMA)
    memo: dict[tuple[int, ...], Reference] = {}

    def constrained_ref(prompt: list[int]) -> Reference:
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = reference_constrained(smollm_reference, ll_tokenizer, so, prompt, MAX_NEW)
        return memo[tuple(prompt)]

    free_ref = ReferenceCache(smollm_reference)

    def make_llm(**overrides: int) -> LLM:
        return LLM(weights=smollm_weights, **{"block_size": 4, "max_num_seqs": 8, **overrides})

    llm = make_llm()
    prompts = _chat_ids(llm, REVIEWS[:4])
    _check(llm, free_ref, constrained_ref, prompts[:1], "alone")
    # The shared system prompt is a cache hit for every request after the first.
    _check(llm, free_ref, constrained_ref, prompts, "mixed batch with prefix-cache hits")
    assert llm.engine.stats().prefix_cache_hits > 3 * 20
    _check(make_llm(max_num_batched_tokens=7), free_ref, constrained_ref, prompts, "chunked prefill (7-token budget)")
    # 40 blocks of 4 tokens for four ~60-token prompts that each grow by up to 48: preempted mid-answer.
    llm = make_llm(num_kv_blocks=40, enable_prefix_caching=False)
    _check(llm, free_ref, constrained_ref, prompts, "preemption")
    assert llm.engine.stats().num_preemptions > 0, "the small cache did not preempt"


# ---- every output that ends follows its grammar ------------------------------------------------
@pytest.fixture(scope="module")
def smollm(smollm_weights: LoadedWeights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=16, max_model_len=1024)


@pytest.fixture(scope="module")
def tiny_random(smollm_weights: LoadedWeights, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A random 2-layer Llama over SmolLM2's tokenizer: it picks tokens the grammar allows almost at
    random, so it walks corners of a grammar a trained model never visits."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=2, bos_token_id=1, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("tiny-random")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    weights = dataclasses.replace(load_weights(str(folder)), tokenizer=smollm_weights.tokenizer)
    return LLM(weights=weights, max_num_seqs=16)


def _assert_outputs_follow(llm: LLM, schema: dict, prompts: list[str], max_tokens: int) -> int:
    """Greedy and sampled; returns how many finished (not cut by max_tokens). A finished one must
    parse and validate; a cut one is refused for what it is (finish_reason "length")."""
    so = StructuredOutputsParams(json=schema)
    params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=i, structured_outputs=so)
              for i, t in enumerate([0.0, 1.0, 1.5] * (len(prompts) // 3 + 1))][: len(prompts)]
    finished = 0
    for out in llm.generate(prompts, params, progress=False):
        assert out.finish_reason in ("stop", "length"), out.error
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            finished += 1
    return finished


@pytest.mark.slow
@pytest.mark.parametrize("schema", SCHEMAS, ids=["labels", "person", "order", "nullable"])
def test_every_finished_answer_validates(smollm: LLM, tiny_random: LLM, schema: dict) -> None:
    prompts = [f"Review {i}: {REVIEWS[i % len(REVIEWS)]}\nJSON:" for i in range(6)]
    assert _assert_outputs_follow(smollm, schema, prompts, max_tokens=120) >= 3
    _assert_outputs_follow(tiny_random, schema, prompts, max_tokens=120)


# Random schemas, drawn with hypothesis: objects (nested once) of the leaf types extraction jobs use,
# with a random required subset. (hypothesis-jsonschema draws the leaf *values* below; it cannot draw
# objects with this hypothesis version: its `from_object_schema` uses a private API that is gone.)
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda t, lo, hi: {"type": t, "minimum": lo, "maximum": hi},
              st.sampled_from(["integer", "number"]), st.integers(-1000, 0), st.integers(0, 1000)),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    st.builds(lambda values: {"enum": values}, st.lists(st.from_regex(r"[a-z ]{1,8}", fullmatch=True),
                                                        min_size=1, max_size=4, unique=True)),
)
NAMES = st.from_regex(r"[a-z_]{1,8}", fullmatch=True)


@st.composite
def object_schemas(draw: st.DrawFn, depth: int = 0) -> dict:
    value = LEAVES if depth else st.one_of(LEAVES, LEAVES.map(lambda s: {"type": "array", "items": s, "maxItems": 3}),
                                           object_schemas(depth=1))
    properties = draw(st.dictionaries(NAMES, value, min_size=1, max_size=4))
    required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@st.composite
def instances(draw: st.DrawFn, schema: dict) -> object:
    """A valid instance: required properties and some optional ones, scalars from hypothesis-jsonschema."""
    if schema.get("type") != "object":
        return draw(from_schema(schema).map(_as_a_model_writes_it))
    names = [n for n in schema["properties"] if n in schema["required"] or draw(st.booleans())]
    return {n: draw(instances(schema["properties"][n])) for n in names}


def _as_a_model_writes_it(value: object) -> object:
    """Numbers in plain decimals: a bounded number's grammar has no exponent form (1e-38), and
    llguidance 1.9 refuses "0.0" (not "0") when the maximum is 0. Whole numbers are written whole."""
    if isinstance(value, list):
        return [_as_a_model_writes_it(v) for v in value]
    if isinstance(value, float):
        value = round(value, 6)
        return int(value) if value.is_integer() else value  # int(-0.0) is 0
    return value




@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), schema=object_schemas())
def test_random_schemas(tiny_random: LLM, ll_tokenizer: llguidance.LLTokenizer, data: st.DataObject,
                        schema: dict) -> None:
    # Whatever the grammar lets a random model write validates...
    _assert_outputs_follow(tiny_random, schema, ["{", "Answer:", "x"], max_tokens=60)
    # ...and a valid answer is never masked away, however it is tokenized. (Written as a model writes
    # it: characters as they are, since the grammar refuses `\u` escapes of printable ones.)
    answer = json.dumps(data.draw(instances(schema)), separators=(",", ":"), ensure_ascii=False)
    ids = tiny_random.tokenizer.encode(answer, add_special_tokens=False)
    assume(tiny_random.tokenizer.decode(ids) == answer)  # SmolLM2's tokenizer loses a few rare characters
    matcher = tiny_random.engine.grammars.matcher(StructuredOutputsParams(json=schema))
    assert matcher.consume_tokens(ids), (answer, schema)
    assert matcher.is_accepting(), (answer, schema)


# ---- the mask ------------------------------------------------------------------------------------
def test_the_c_kernel_and_the_numpy_fallback_mask_alike() -> None:
    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(5, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # a free row
    bitmask[2] = 0  # nothing allowed
    logits = torch.randn(5, vocab)
    expected = torch.from_numpy(logits.numpy().copy())
    llguidance.numpy.apply_token_bitmask_inplace(expected.numpy(), bitmask)
    for apply in (apply_bitmask, apply_bitmask_unpacked):
        got = logits.clone()
        apply(got, bitmask)
        assert torch.equal(got, expected), apply.__name__
    assert torch.equal(expected[1], logits[1]) and bool(torch.isinf(expected[2]).all())


def test_free_rows_are_not_masked(smollm: LLM) -> None:
    matcher = smollm.engine.grammars.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = allowed_tokens_bitmask([(matcher, 1, [])], 3, 49152)
    assert (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    allowed = np.unpackbits(bitmask[1].view(np.uint8), bitorder="little")
    yes, no = (smollm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    assert allowed[yes] and allowed[no] and 0 < allowed.sum() < 100


# ---- behaviour -----------------------------------------------------------------------------------
def test_a_choice_costs_one_step_per_label_token_and_ends_without_eos(smollm: LLM) -> None:
    labels = ["positive", "negative", "mixed", "informative", "not sure"]  # the last two: two tokens each
    engine = smollm.engine
    params = SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(choice=labels))
    for review in REVIEWS[:3]:
        steps_before = engine.stats().num_steps
        out = smollm.chat(conversation(review), params, progress=False)[0]
        assert out.text in labels and out.finish_reason == "stop"
        # The label's own tokens (no other spelling of it, no EOS after it)...
        assert out.token_ids == smollm.tokenizer.encode(out.text, add_special_tokens=False)
        # ...one step each: the prefill step samples the first.
        assert engine.stats().num_steps - steps_before == len(out.token_ids)


def test_eos_only_where_the_grammar_may_end(smollm: LLM) -> None:
    """A regex with a fixed length: EOS is masked until it is complete, whatever the model wants."""
    so = StructuredOutputsParams(regex=r"[0-9]{12}")
    params = SamplingParams(max_tokens=40, temperature=0, structured_outputs=so)
    out = smollm.generate("The end.", params, progress=False)[0]
    assert out.finish_reason == "stop" and len(out.text) == 12 and out.text.isdigit()


def test_cut_by_max_tokens_is_length_and_the_matcher_state_is_per_request(smollm: LLM) -> None:
    so = StructuredOutputsParams(json=LABEL_SCHEMA)
    short, full = smollm.chat([conversation(REVIEWS[0])] * 2, [
        SamplingParams(max_tokens=5, temperature=0, structured_outputs=so),
        SamplingParams(max_tokens=200, temperature=0, structured_outputs=so)], progress=False)
    assert short.finish_reason == "length" and full.finish_reason == "stop", full.text
    assert full.token_ids[:5] == short.token_ids
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)
    jsonschema.validate(json.loads(full.text), LABEL_SCHEMA)


def test_a_seeded_sampled_answer_does_not_depend_on_its_batch(smollm: LLM) -> None:
    so = StructuredOutputsParams(json=LABEL_SCHEMA)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, structured_outputs=so)
    alone = smollm.chat(conversation(REVIEWS[1]), params, progress=False)[0]
    crowd = [conversation(r) for r in REVIEWS]
    in_batch = smollm.chat(crowd, [params if i == 1 else SamplingParams(max_tokens=30, temperature=1.0)
                                   for i in range(len(crowd))], progress=False)[1]
    assert alone.token_ids == in_batch.token_ids


def test_stop_strings_still_apply(smollm: LLM) -> None:
    so = StructuredOutputsParams(json=LABEL_SCHEMA)
    out = smollm.chat(conversation(REVIEWS[0]), SamplingParams(max_tokens=MAX_NEW, temperature=0, stop=['"summary"'],
                                                               structured_outputs=so), progress=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == '"summary"' and out.text.startswith('{"label":')


def test_each_distinct_setting_compiles_once(smollm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = smollm.engine.grammars
    builds: list[str] = []
    build = compiler._build

    def counting_build(tokenizer, hf_tokenizer, so):  # type: ignore[no-untyped-def]
        builds.append(so.kind)
        return build(tokenizer, hf_tokenizer, so)

    monkeypatch.setattr(compiler, "_build", counting_build)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "x-unique": 1}
    for _ in range(50):
        so = StructuredOutputsParams(json=dict(schema))  # equal, not the same object
        smollm.engine.process_request("x", SamplingParams(structured_outputs=so))
    bad = StructuredOutputsParams(regex="(unclosed")
    for _ in range(3):
        with pytest.raises(ValueError, match="unclosed group"):
            smollm.engine.check_structured_outputs(bad)
    assert builds == ["json", "regex"]
    # The same properties in another order are another grammar: answers follow the schema's order.
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    reordered = {"type": "object", "properties": {"b": digit, "a": digit},
                 "required": ["a", "b"], "additionalProperties": False}
    for properties in (reordered["properties"], dict(reversed(reordered["properties"].items()))):
        so = StructuredOutputsParams(json={**reordered, "properties": properties})
        out = smollm.generate("x", SamplingParams(max_tokens=20, temperature=0, structured_outputs=so),
                              progress=False)[0]
        assert list(json.loads(out.text)) == list(properties)


@pytest.mark.parametrize(("so", "why"), [
    (StructuredOutputsParams(json={"type": "strnig"}), "structured_outputs.json: .*strnig"),
    (StructuredOutputsParams(json={"type": "string", "format": "credit-card"}),
     "structured_outputs.json: Unknown format"),
    (StructuredOutputsParams(regex="(ab"), "(?s)structured_outputs.regex: .*unclosed group"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "structured_outputs.grammar: .*missing_rule"),
])
def test_a_grammar_that_does_not_compile_refuses_its_request_only(smollm: LLM, so: StructuredOutputsParams,
                                                                  why: str) -> None:
    with pytest.raises(ValueError, match=why):
        smollm.engine.check_structured_outputs(so)
    bad, good = smollm.generate(["a", "b"], [SamplingParams(max_tokens=3, structured_outputs=so),
                                             SamplingParams(max_tokens=3)], progress=False)
    assert bad.finish_reason == "error" and bad.error and bad.error.startswith(f"structured_outputs.{so.kind}: ")
    assert good.finish_reason == "length"


def test_a_compile_over_the_time_limit_fails_that_request(smollm_weights: LoadedWeights) -> None:
    """A microsecond: at 100 µs this schema once compiled in time on a fast run (llguidance builds
    lazily), and the request went through."""
    llm = LLM(weights=smollm_weights, max_num_seqs=2, grammar_compile_timeout_s=1e-6)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i + 1},{i + 40}}}$"}
                                            for i in range(60)}}
    out = llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=big)),
                       progress=False)[0]
    assert out.finish_reason == "error" and "took longer than 1e-06 s" in str(out.error)
    assert llm.generate("x", SamplingParams(max_tokens=2), progress=False)[0].finish_reason == "length"


# ---- schemas no finite value satisfies -------------------------------------------------------------
ENDLESS = "structured_outputs.json: Unsatisfiable schema: no finite value satisfies it"


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"allOf": [{"$ref": "#"}]},
    {"anyOf": [{"$ref": "#"}]},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "additionalProperties": {"$ref": "#"}, "required": ["a"]},
    {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"definitions": {"n": {"type": "object", "properties": {"next": {"$ref": "#/definitions/n"}},
                           "required": ["next"]}}, "$ref": "#/definitions/n"},
], ids=["ref", "allOf", "anyOf", "property", "additionalProperties", "prefixItems", "items", "definitions"])
def test_a_schema_whose_refs_only_lead_back_to_themselves_is_refused(schema: dict) -> None:
    """llguidance compiles these, and the answer is "" with "stop" (as if complete) or cut with
    "error": they are refused up front, as llguidance refuses the other unsatisfiable ones."""
    with pytest.raises(ValueError, match=f"^{re.escape(ENDLESS)}"):
        check_grammar(StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=f"^{re.escape(ENDLESS)}"):
        check_grammar(StructuredOutputsParams(json=json.dumps(schema)))  # a schema given as its text


@pytest.mark.parametrize(("schema", "value", "endless"), [
    # a tree: a leaf has no children; every node needing one more child is endless
    ({"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}},
     {"children": [{"children": []}, {}]},
     {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
      "required": ["children"]}),
    # a linked list ends in null; without the null it is endless
    ({"type": "object", "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["next"]},
     {"next": {"next": None}},
     {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}]}}, "required": ["next"]}),
    ({"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                   "required": ["next"]}]}},
      "$ref": "#/$defs/n"},
     {"next": {"next": None}},
     {"$defs": {"n": {"anyOf": [{"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                 "required": ["next"]}]}},
      "$ref": "#/$defs/n"}),
    # properties and required only constrain objects: without "type" a string satisfies it
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     "text",
     {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    ({"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     None,
     {"type": ["object", "array"], "properties": {"a": {"$ref": "#"}}, "required": ["a"], "minItems": 1,
      "items": {"$ref": "#"}}),
], ids=["tree", "list", "list-in-defs", "untyped", "type-list"])
def test_a_recursive_schema_a_finite_value_satisfies_is_served_and_its_endless_twin_refused(
        schema: dict, value: object, endless: dict) -> None:
    jsonschema.validate(value, schema)
    check_grammar(StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=f"^{re.escape(ENDLESS)}"):
        check_grammar(StructuredOutputsParams(json=endless))


def test_a_request_whose_schema_no_finite_value_satisfies_is_a_request_error(smollm: LLM) -> None:
    """The server's and the Batch API's check (a RequestError is their 400, or the line's
    invalid_request row), and the offline API's: the request fails, not "" with "stop"."""
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}
    with pytest.raises(RequestError) as exc:
        check_structured_outputs(parse_request(CHAT_URL, body), smollm)
    assert exc.value.param == "response_format"
    assert str(exc.value).startswith("body.response_format.json_schema.schema: Unsatisfiable schema: no finite value")
    so = StructuredOutputsParams(json={"$ref": "#"})
    out = smollm.generate("x", SamplingParams(max_tokens=4, structured_outputs=so), progress=False)[0]
    assert out.finish_reason == "error" and str(out.error).startswith(ENDLESS)


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="exactly one of json, json_object, choice, regex, grammar"):
        StructuredOutputsParams(choice=["a"], regex="a")
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.regex must be a non-empty string"):
        StructuredOutputsParams(regex="")


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=1)
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(choice=["a"]))
    out = llm.generate([[1, 2, 3]], params, progress=False)[0]
    assert out.finish_reason == "error" and "needs the model's tokenizer" in str(out.error)
