"""The offline API on the embedded model: outputs, stops, seeds, timings, bad input."""

from __future__ import annotations

import copy

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine import chat_prompt_ids
from tokenmill.models.loader import LoadedWeights


@pytest.fixture(scope="module")
def llm(smollm_weights: LoadedWeights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=8, max_model_len=512)


def test_outputs_carry_text_counts_and_monotonic_timings(llm: LLM) -> None:
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0), progress=False)[0]
    assert out.finished and out.finish_reason == "length" and out.num_output_tokens == 8
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.num_prompt_tokens == len(out.prompt_token_ids) == 5
    t = out.timings
    assert t.arrival <= t.scheduled <= t.first_token <= t.finished


def test_chat_applies_the_template_and_stops_at_eos(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=60, temperature=0),
                   progress=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    assert "4" in out.text and "<|im_end|>" not in out.text
    assert "<|im_start|>assistant" in llm.tokenizer.decode(out.prompt_token_ids)


# Qwen3's switch, as its chat template has it.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
)


def test_a_thinking_template_does_not_think_unless_asked(llm: LLM) -> None:
    tok = copy.deepcopy(llm.tokenizer)
    tok.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "Is 7 prime?"}]
    assert tok.decode(chat_prompt_ids(tok, messages)).endswith("<|assistant|><think>\n\n</think>\n\n")
    assert tok.decode(chat_prompt_ids(tok, messages, {"enable_thinking": True})).endswith("<|assistant|>")
    # Plain templates ignore the variable.
    thinking = {"enable_thinking": True}
    assert chat_prompt_ids(llm.tokenizer, messages) == chat_prompt_ids(llm.tokenizer, messages, thinking)


def test_stop_strings_cut_the_text_and_name_the_reason(llm: LLM) -> None:
    base = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0),
                        progress=False)[0]
    assert "\n" in base.text  # ' Paris.\n\nThe answer is...'
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=12, temperature=0, stop=["\n"]),
                       progress=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == "\n"
    assert out.text == base.text[: base.text.index("\n")]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0), progress=False)[0]
    stop_id = base.token_ids[2]
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[stop_id]), progress=False)[0]
    assert out.token_ids == base.token_ids[:3] and out.stop_reason == stop_id
    chat = [{"role": "user", "content": "What is 2+2?"}]
    short = llm.chat(chat, SamplingParams(max_tokens=60, temperature=0), progress=False)[0]
    assert short.finish_reason == "stop"
    forced = llm.chat(chat, SamplingParams(max_tokens=60, temperature=0, min_tokens=short.num_output_tokens + 3),
                      progress=False)[0]
    assert forced.num_output_tokens >= short.num_output_tokens + 3
    assert forced.token_ids[: short.num_output_tokens - 1] == short.token_ids[:-1]


def test_seeded_sampling_does_not_depend_on_the_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm.generate("Tell me a story about", params, progress=False)[0]
    others = [f"Prompt number {i} is about" for i in range(5)]
    batch = llm.generate([*others, "Tell me a story about"], params, progress=False)
    assert batch[-1].token_ids == alone.token_ids
    reseeded = llm.generate("Tell me a story about", SamplingParams(max_tokens=10, temperature=0.9, seed=9),
                            progress=False)[0]
    assert reseeded.token_ids != alone.token_ids


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "prompt is empty"),
        ({"prompt_token_ids": []}, None, "prompt is empty"),
        ({"prompt_token_ids": [1] * 600}, None, "prompt has 600 tokens but the context is 512"),
        ({"prompt_token_ids": [10**7]}, None, "outside the vocabulary"),
        ("x" * 10**6, None, "prompt has 1,000,000 characters: more than a context of 512 tokens can hold"),
        ("Hi", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids: 10000000 is outside the vocabulary"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(llm: LLM, prompt, params, message) -> None:  # type: ignore[no-untyped-def]
    engine = llm.engine
    engine.add_request("Hello there", SamplingParams(max_tokens=4, temperature=0), request_id="good")
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("Hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("Hi", request_id="good")
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"] and done[0].num_output_tokens == 4


def test_a_request_that_can_never_fit_the_cache_fails_alone(smollm_weights: LoadedWeights) -> None:
    """One prompt bigger than the whole KV cache gets an error output; the others are answered."""
    small = LLM(weights=smollm_weights, num_kv_blocks=12, block_size=16, max_num_seqs=16, max_model_len=1024)
    prompts: list = [f"Fact number {i}:" for i in range(7)]
    prompts.insert(3, {"prompt_token_ids": [5] * 925})
    outs = small.generate(prompts, SamplingParams(max_tokens=2, temperature=0), progress=False)
    refused = outs[3]
    assert refused.finished and refused.finish_reason == "error" and refused.num_output_tokens == 0
    assert "needs up to 58 KV-cache blocks" in (refused.error or "") and "has only 12" in (refused.error or "")
    assert [o.num_output_tokens for i, o in enumerate(outs) if i != 3] == [2] * 7
    assert all(o.error is None for i, o in enumerate(outs) if i != 3)
    with pytest.raises(ValueError, match="KV-cache blocks"):  # the opt-in: raise before anything runs
        small.generate(prompts, SamplingParams(max_tokens=2), progress=False, raise_on_error=True)
    assert not small.engine.has_unfinished_requests()


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("A long story begins", SamplingParams(max_tokens=50), request_id="gone")
    engine.step()
    assert engine.block_manager.num_free_blocks < free_before
    aborted = engine.abort_request("gone")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests() and engine.abort_request("gone") is None
