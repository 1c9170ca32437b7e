"""Speculative decoding in the engine: under greedy (and under a seed) the output is token for token
the output without drafts, on every cache path, with structured outputs, stops and logprobs; the
model's drafts are verified against transformers too; rejected drafts leave no trace in the KV
cache; sampled drafts keep the target's distribution."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest
import torch

from tests.models.test_equivalence import _prompts
from tests.reference import TIE_TOLERANCE, ReferenceCache
from tokenmill.engine import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.engine.interface import RequestOutput
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sequence import Sequence
from tokenmill.engine.speculative import Drafter, accepted_prefix
from tokenmill.engine.speculative.budget import DraftBudget
from tokenmill.models.loader import LoadedWeights

METHODS = ["ngram", "suffix"]
DOC = ("Order 4471 from Acme Corp, dated 2024-03-01, ships to Globex Ltd, 12 Elm Street, Springfield. "
       "Total due: 1,250.00 EUR, payment terms net 30 days. Contact jane.doe@acme.example.")
SCHEMA = {"type": "object", "properties": {"customer": {"type": "string", "maxLength": 40},
                                           "total": {"type": "string", "maxLength": 20},
                                           "contact": {"type": "string", "maxLength": 40}},
          "required": ["customer", "total", "contact"], "additionalProperties": False}


@pytest.fixture(autouse=True)
def every_draft_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactness is verification's: every proposed draft is verified here, whatever the step costs
    (the budget, which would keep fewer on a busy machine, is tested on its own: test_budget.py)."""
    monkeypatch.setattr(DraftBudget, "plan", lambda self, drafts, forced: [len(d) for d in drafts])


def _chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Copy this text exactly, then say done.\n{DOC} Ref {i}."}] for i in range(n)]


def _run(weights: LoadedWeights, method: str | None, params: Any, n: int = 4,
         **config: Any) -> tuple[LLM, list[RequestOutput]]:
    """The chats' outputs; greedy ones with their top-2 logprobs, to tell a near-tie (below) from a bug."""
    if isinstance(params, SamplingParams) and params.greedy and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=2)
    llm = LLM(weights=weights, max_model_len=512, speculative_method=method, **config)
    return llm, llm.chat(_chats(n), params, progress=False)


def _same(plain: list[RequestOutput], drafted: list[RequestOutput]) -> None:
    """Token for token, or parted at an fp32 near-tie: a step of 1 + k tokens runs the linear layers
    at another row count than a plain decode, so logits differ by ~1e-5 (tests/reference.py)."""
    for a, b in zip(plain, drafted, strict=True):
        step = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None)
        if step is None:
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), a.request_id
            continue
        assert a.logprobs is not None, f"{a.request_id}: parted at step {step} of a sampled request"
        top = a.logprobs[step].top
        assert b.token_ids[step] in [t for t, _ in top[:2]] and top[0][1] - top[1][1] <= TIE_TOLERANCE, (
            f"{a.request_id}: step {step}: {b.token_ids[step]} with drafts, {a.token_ids[step]} without, "
            f"top-2 {top[:2]}")


CACHE_PATHS = {
    "plain": {"max_num_seqs": 4},
    "chunked prefill, drafts cut by the budget": {"max_num_seqs": 4, "max_num_batched_tokens": 24},
    "preemption by recompute": {"max_num_seqs": 4, "num_kv_blocks": 20, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", sorted(CACHE_PATHS))
def test_greedy_output_is_the_plain_engines_on_every_cache_path(smollm_weights: LoadedWeights, method: str,
                                                                path: str) -> None:
    params = SamplingParams(max_tokens=64, temperature=0)
    _, plain = _run(smollm_weights, None, params, **CACHE_PATHS[path])
    llm, drafted = _run(smollm_weights, method, params, **CACHE_PATHS[path])
    _same(plain, drafted)
    stats = llm.engine.stats()
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the path was not exercised"
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    if path.startswith("preemption"):
        assert stats.num_preemptions > 0, "the small cache did not preempt"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_prefix_hit_after_drafts_reads_only_real_tokens(smollm_weights: LoadedWeights) -> None:
    """Rejected drafts' KV is never cached: a second wave that hits the first wave's blocks (prompts
    and outputs) decodes as the plain engine does, and every cached block holds a real sequence's tokens."""
    params = SamplingParams(max_tokens=48, temperature=0)
    llm = LLM(weights=smollm_weights, max_model_len=512, max_num_seqs=4, speculative_method="suffix")
    first = llm.chat(_chats(4), params, progress=False)
    real = [o.prompt_token_ids + o.token_ids for o in first]
    bm = llm.engine.block_manager
    cached = [b for b in bm.blocks if b.block_hash is not None]
    assert cached
    for block in cached:
        assert any(list(block.token_ids) in [seq[i:i + bm.block_size] for i in range(0, len(seq), bm.block_size)]
                   for seq in real), "a cached block holds tokens no sequence has"
    again = [[*chat, {"role": "assistant", "content": o.text}, {"role": "user", "content": "Again."}]
             for chat, o in zip(_chats(4), first, strict=True)]
    hits_before = llm.engine.stats().prefix_cache_hits
    drafted = llm.chat(again, params, progress=False)
    assert llm.engine.stats().prefix_cache_hits - hits_before > 0
    plain = LLM(weights=smollm_weights, max_model_len=512, max_num_seqs=4).chat(again, params, progress=False)
    _same(plain, drafted)


@pytest.mark.parametrize("method", METHODS)
def test_structured_outputs_stop_strings_and_logprobs_stay_exact(smollm_weights: LoadedWeights, method: str) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    cases = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=so),
             SamplingParams(max_tokens=80, temperature=0, stop=["Springfield"]),
             SamplingParams(max_tokens=37, temperature=0, logprobs=3)]
    for params in cases:
        _, plain = _run(smollm_weights, None, params)
        llm, drafted = _run(smollm_weights, method, params)
        _same(plain, drafted)
        assert llm.engine.stats().num_accepted_tokens > 0
        for a, b in zip(plain, drafted, strict=True):
            if params.structured_outputs is not None:
                jsonschema.validate(json.loads(b.text), SCHEMA)
            if params.stop:
                assert b.stop_reason == "Springfield" and "Springfield" not in b.text
            if params.logprobs is not None:
                assert a.logprobs is not None and b.logprobs is not None and len(b.logprobs) == len(b.token_ids) == 37
                for x, y in zip(a.logprobs, b.logprobs, strict=True):
                    assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < TIE_TOLERANCE
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_drafted_output_matches_transformers(tiny_llama: tuple[LoadedWeights, torch.nn.Module],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts from an oracle that knows transformers' continuation and gets every third draft's
    last token wrong: accepted runs, rejections and rollbacks at every depth, checked against it."""
    weights, model = tiny_llama
    reference = ReferenceCache(model)
    prompts = _prompts(512, [5, 17, 30, 9], seed=5)
    max_new = 40
    truth = {tuple(p): reference(p, max_new).tokens for p in prompts}
    calls = iter(range(10**6))

    def oracle(self: Drafter, seq: Sequence, state: Any) -> list[int]:
        have = seq.num_output_tokens
        draft = truth[tuple(seq.prompt_token_ids)][have : have + state.draft_len]
        draft = draft[: max(0, seq.params.max_tokens - have - 1)]
        if draft and next(calls) % 3 == 0:
            draft[-1] = (draft[-1] + 1) % 512
        return draft

    monkeypatch.setattr(Drafter, "_draft", oracle)
    told: list[tuple[int, int]] = []  # what the drafter learns: (drafts verified, accepted), per draft
    verified = Drafter.verified
    monkeypatch.setattr(Drafter, "verified", lambda self, seq, n, accepted: (
        told.append((n, accepted)) if n else None, verified(self, seq, n, accepted)))
    llm = LLM(weights=weights, block_size=4, max_num_seqs=4, kv_cache_dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True), progress=False)
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # The draft lengths and the budget's rates learn from the drafts that ran, and from no others.
    assert (len(told), sum(n for n, _ in told), sum(a for _, a in told)) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    for prompt, out in zip(prompts, outs, strict=True):
        reference.check(prompt, out.token_ids, "drafts")


def test_seeded_sampling_gives_the_same_tokens_with_drafts(smollm_weights: LoadedWeights) -> None:
    """The noise of a sampled token comes from (seed, position): a draft is kept where it equals the
    token sampled at its place, so a seed's output does not depend on drafts."""
    params = [SamplingParams(max_tokens=48, temperature=0.7, seed=seed) for seed in range(6)]
    chats = _chats(6)
    plain = LLM(weights=smollm_weights, max_model_len=512).chat(chats, params, progress=False)
    llm = LLM(weights=smollm_weights, max_model_len=512, speculative_method="ngram")
    drafted = llm.chat(chats, params, progress=False)
    _same(plain, drafted)
    assert llm.engine.stats().num_accepted_tokens > 0


def test_a_sampled_token_after_a_draft_follows_the_target_distribution() -> None:
    """Speculative sampling's rule for a one-token draft d (keep d with probability p(d), else draw from
    p without d): over many seeds the token at the draft's position is distributed as p, and d is kept
    as often as p(d) says (chi-square at p = 0.001)."""
    probs = torch.tensor([0.05, 0.3, 0.1, 0.2, 0.15, 0.05, 0.1, 0.05])
    logits = probs.log()[None, :].repeat(2, 1)
    draft, draws = 1, 4000
    counts = torch.zeros(len(probs))
    kept = 0
    sampler = Sampler(eos_token_ids=[])
    for seed in range(draws):
        seq = Sequence("r", [3, 4], SamplingParams(temperature=1.0), seed=seed)
        seq.draft_token_ids = [draft]
        sampled = sampler(logits.clone(), [seq, seq], [0, 1]).token_ids
        tokens = accepted_prefix(seq.draft_token_ids, sampled)
        counts[tokens[0]] += 1
        kept += tokens[0] == draft and len(tokens) == 2
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, f"chi-square {chi2:.1f} over 7 degrees of freedom: not the target distribution"
    assert abs(kept / draws - float(probs[draft])) < 0.03
