"""/metrics of a server that speculates: vLLM's spec_decode counters, and per-token latency that
counts each of a step's verified tokens."""

from __future__ import annotations

import openai

from tests.serve.conftest import MODEL, serving
from tests.serve_helpers import scrape
from tokenmill.engine.llm import LLM
from tokenmill.models.loader import LoadedWeights

TEXT = ("Order 4471 from Acme Corp, dated 2024-03-01, ships to Globex Ltd, 12 Elm Street, Springfield. "
        "Total due: 1,250.00 EUR, payment terms net 30 days.")


def test_spec_decode_counters_under_both_names(smollm_weights: LoadedWeights, tmp_path) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(weights=smollm_weights, max_num_seqs=4, max_model_len=512, speculative_method="ngram")
    with serving(llm, tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        before = scrape(server)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Copy this text exactly:\n{TEXT}"}],
            max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        after = scrape(server)

    def moved(name: str, vllm: bool = False) -> float:
        key = (name, frozenset({"model_name": MODEL}.items()) if vllm else frozenset())
        return after[key] - before.get(key, 0.0)

    drafts = moved("tokenmill_spec_decode_num_draft_tokens_total")
    accepted = moved("tokenmill_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafts and moved("tokenmill_spec_decode_num_drafts_total") > 0
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert moved(f"vllm:{name}", vllm=True) == moved(f"tokenmill_{name}")
    assert out.usage.completion_tokens == 48
    assert moved("tokenmill_generation_tokens_total") == 48
    assert moved("tokenmill_inter_token_latency_seconds_count") == 47  # one gap a token, however many a step brought
