"""Golden tests: the engine's greedy output equals transformers', on every cache path."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.reference import ReferenceCache, assert_matches_reference
from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import LoadedWeights, load_weights

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _check(llm: LLM, ref: ReferenceCache, prompts: list[list[int]], what: str) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, progress=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        assert_matches_reference(out.token_ids, ref(prompt, MAX_NEW), f"{what} prompt {i}")
        assert out.finish_reason == "length"


def _check_cache_paths(make_llm: Callable[..., LLM], ref: ReferenceCache, vocab: int) -> None:
    mixed = _prompts(vocab, [1, 5, 17, 33, 8, 50])
    _check(make_llm(), ref, mixed[:1], "single prompt")
    _check(make_llm(), ref, mixed, "mixed-length batch")
    _check(make_llm(max_num_batched_tokens=7), ref, mixed, "chunked prefill (7-token budget)")

    shared = _prompts(vocab, [40], seed=1)[0]
    tails = _prompts(vocab, [3, 9, 1, 14], seed=2)
    prefixed = [shared + t for t in tails] + [shared]
    llm = make_llm()
    _check(llm, ref, prefixed[:1], "prefix warm-up")
    _check(llm, ref, prefixed, "prefix-cache hits")
    stats = llm.engine.scheduler.stats
    assert stats.prefix_cache_hits >= 4 * 40 - 4 * 4, "shared 40-token prefix was not served from cache"

    llm = make_llm(num_kv_blocks=12)  # 48 tokens of 4-token blocks: forces preemption
    _check(llm, ref, _prompts(vocab, [20, 18, 15, 22, 9], seed=3), "preemption")
    assert llm.engine.scheduler.stats.num_preemptions > 0, "the small cache did not preempt"
    _check_arrivals(make_llm(), ref, vocab)


def _check_arrivals(llm: LLM, ref: ReferenceCache, vocab: int) -> None:
    """Requests that arrive while others are decoding join the running batch."""
    engine = llm.engine
    prompts = _prompts(vocab, [12, 30, 7, 25], seed=4)
    finished = {}
    for i, prompt in enumerate(prompts):
        engine.add_request({"prompt_token_ids": prompt}, GREEDY, request_id=f"r{i}")
        for _ in range(3):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for i, prompt in enumerate(prompts):
        assert_matches_reference(finished[f"r{i}"].token_ids, ref(prompt, MAX_NEW), f"arrival {i}")


# ---- tiny random models built from transformers configs ------------------------------------
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.2, tie_word_embeddings=False,
)


def _tiny_config(arch: str):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if arch == "llama":  # with Llama-3 rope scaling and tied embeddings
        return LlamaConfig(**{**TINY, "tie_word_embeddings": True}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        }, rope_theta=10000.0)
    if arch == "qwen2":  # QKV bias
        return Qwen2Config(**TINY)
    return MistralConfig(**TINY, sliding_window=24, head_dim=16)  # window shorter than prompts


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(request.param)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model


# The C kernels (paged decode attention, small-batch linears), or PyTorch ops only.
KERNELS = {"kernels": {"decode_attention": "kernel", "small_batch_linear": "kernel"},
           "torch": {"decode_attention": "sdpa", "small_batch_linear": "off"}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "ops"), [("fcfs", "kernels"), ("priority", "kernels"), ("length", "kernels"), ("fcfs", "torch")],
)
def test_tiny_models_match_transformers_on_every_cache_path(tiny_model, policy: str, ops: str) -> None:  # type: ignore[no-untyped-def]
    folder, model = tiny_model
    weights = load_weights(str(folder))
    assert weights.config.model_type == model.config.model_type

    def make_llm(**overrides: int) -> LLM:
        settings = {"block_size": 4, "max_num_seqs": 8, "scheduling_policy": policy, **KERNELS[ops], **overrides}
        return LLM(weights=weights, **settings)

    _check_cache_paths(make_llm, ReferenceCache(model), vocab=512)


@pytest.mark.parametrize("ops", KERNELS)
def test_uninitialised_kv_memory_never_leaks_into_attention(tiny_model, ops: str) -> None:  # type: ignore[no-untyped-def]
    """The cache is allocated uninitialised and whole blocks are gathered; poison it with NaN
    to stand for garbage and the output must still match the reference."""
    folder, model = tiny_model
    llm = LLM(weights=load_weights(str(folder)), block_size=8, max_num_seqs=4, **KERNELS[ops])
    for k, v in llm.engine.runner.kv_caches:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    prompts = _prompts(512, [3, 11, 21], seed=5)
    _check(llm, ReferenceCache(model), prompts, "NaN-poisoned cache")


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_on_every_cache_path(
    smollm_weights: LoadedWeights, smollm_reference: torch.nn.Module
) -> None:
    def make_llm(**overrides: int) -> LLM:
        return LLM(weights=smollm_weights, **{"block_size": 4, "max_num_seqs": 8, **overrides})

    _check_cache_paths(make_llm, ReferenceCache(smollm_reference), vocab=49152)


@pytest.mark.slow
def test_smollm2_text_prompts_match_transformers(
    smollm_weights: LoadedWeights, smollm_reference: torch.nn.Module
) -> None:
    llm = LLM(weights=smollm_weights, max_num_seqs=4)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    outs = llm.generate(prompts, GREEDY, progress=False)
    ref = ReferenceCache(smollm_reference)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(out.token_ids, ref(out.prompt_token_ids, MAX_NEW), prompt)
    assert "Paris" in outs[0].text
