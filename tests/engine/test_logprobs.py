"""Per-token log-probabilities (SamplingParams.logprobs): equal to transformers' own distribution at
each step, on plain batches and through preemption; over the allowed tokens only for a structured
output; one per output token when a stop string cuts the text."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_equivalence import _prompts
from tokenmill.engine import LLM, RequestOutput, SamplingParams, StructuredOutputsParams
from tokenmill.models.loader import LoadedWeights

MAX_NEW = 10
TOP = 3
ATOL = 1e-3  # fp32 noise between two implementations is ~1e-5 on these logits
# An fp32 KV cache: these tests are about the logprobs' bookkeeping (the fp16 cache's ~1e-3 moves
# of these logits are bounded in tests/models/test_equivalence.py).
FP32_KV = {"kv_cache_dtype": "float32"}


@torch.inference_mode()
def _reference_logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """transformers' log_softmax before each generated token, teacher-forced on the engine's own
    tokens (so a near-tie flip in greedy decoding cannot make the two runs part ways)."""
    logits = model(input_ids=torch.tensor([prompt + generated])).logits[0].float()
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


def _assert_matches_reference(out: RequestOutput, prompt: list[int], model: torch.nn.Module) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == MAX_NEW
    expected = _reference_logprobs(model, prompt, out.token_ids)
    for step, (token, found) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert found.token_id == token
        assert found.logprob == pytest.approx(float(expected[step, token]), abs=ATOL), f"step {step}"
        values, ids = expected[step].topk(TOP)
        assert [v for _, v in found.top] == pytest.approx(values.tolist(), abs=ATOL), f"step {step}"
        assert [v for _, v in found.top] == sorted((v for _, v in found.top), reverse=True)
        # The ids, where no two of the reference's top values are a near-tie apart.
        gaps = (values[:-1] - values[1:]).abs()
        if bool((gaps > ATOL).all()):
            assert [t for t, _ in found.top] == ids.tolist(), f"step {step}"
        # Greedy: the chosen token is the most likely one.
        assert found.logprob == pytest.approx(found.top[0][1], abs=ATOL)


def test_greedy_logprobs_equal_transformers_and_only_requests_that_ask_get_them(
    tiny_llama: tuple[LoadedWeights, torch.nn.Module],
) -> None:
    weights, model = tiny_llama
    llm = LLM(weights=weights, block_size=4, max_num_seqs=8, **FP32_KV)
    prompts = _prompts(512, [1, 5, 17, 33])
    asks = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=TOP)
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [asks, plain, asks, asks], progress=False)
    assert outs[1].logprobs is None
    for i in (0, 2, 3):
        _assert_matches_reference(outs[i], prompts[i], model)


def test_logprobs_survive_preemption_once_per_token(tiny_llama: tuple[LoadedWeights, torch.nn.Module]) -> None:
    """A preempted request recomputes the tokens it had: their logprobs are neither lost nor doubled."""
    weights, model = tiny_llama
    llm = LLM(weights=weights, block_size=4, max_num_seqs=8, num_kv_blocks=12, **FP32_KV)  # 48 tokens: preempts
    prompts = _prompts(512, [20, 18, 15, 22, 9], seed=3)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    assert llm.engine.stats().num_preemptions > 0, "the small cache did not preempt"
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_matches_reference(out, prompt, model)


# ---- on the embedded model, with its tokenizer ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm(smollm_weights: LoadedWeights) -> LLM:
    return LLM(weights=smollm_weights, max_num_seqs=4, max_model_len=512)


LABELS = ["positive", "negative", "mixed"]


def test_a_choice_has_logprobs_over_its_allowed_tokens_only(smollm: LLM) -> None:
    prompt = "Review: The lid broke after a week, but the kettle is fast.\nSentiment:"
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5, structured_outputs=StructuredOutputsParams(
        choice=LABELS))
    [out] = smollm.generate(prompt, params, progress=False)
    assert out.text in LABELS and out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    decode = smollm.tokenizer.decode
    text = ""
    for found in out.logprobs:
        assert found.top and found.top[0][0] == found.token_id  # greedy: the top-1 allowed token
        # Every alternative keeps the text on the way to a label: the grammar's tokens, no others.
        assert all(any(label.startswith(text + decode([t])) for label in LABELS) for t, _ in found.top)
        assert sum(torch.tensor([v for _, v in found.top]).exp().tolist()) <= 1 + 1e-5
        text += decode([found.token_id])
    assert text == out.text
    # Restricted to the labels, the first token is more likely than the unconstrained model makes it.
    [free] = smollm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0), progress=False)
    assert free.logprobs is not None
    if free.token_ids[0] == out.token_ids[0]:
        assert out.logprobs[0].logprob >= free.logprobs[0].logprob


def test_a_stop_string_cuts_the_text_and_the_logprobs_stay_one_per_token(smollm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, stop=[" "], logprobs=1)
    [out] = smollm.generate("The capital of France is Paris. The capital of Italy is", params, progress=False)
    assert out.stop_reason == " " and out.logprobs is not None
    assert len(out.logprobs) == len(out.token_ids) and [lp.token_id for lp in out.logprobs] == out.token_ids
