"""vLLM's per-token logprob dicts as tokenmill's TokenLogprobs (no vLLM needed: its `Logprob` is
stood in for; tests/vllm_engine/test_vllm.py checks the real ones against transformers)."""

from __future__ import annotations

from types import SimpleNamespace

from tokenmill.engine import TokenLogprob
from tokenmill.vllm_engine.engine import token_logprobs


def _logprob(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token=None)


def test_the_sampled_token_and_the_n_ranked_first_in_rank_order() -> None:
    positions = [
        {7: _logprob(-0.1, 1), 9: _logprob(-2.5, 2)},  # the sampled token is the top one
        {4: _logprob(-3.0, 5), 2: _logprob(-0.2, 1), 8: _logprob(-1.9, 2)},  # … sampled below the top 2
        {5: _logprob(-0.7, 1)},  # n = 0 asks for the sampled token alone
    ]
    assert token_logprobs([7, 4], positions[:2], 2) == [
        TokenLogprob(7, -0.1, ((7, -0.1), (9, -2.5))),
        TokenLogprob(4, -3.0, ((2, -0.2), (8, -1.9))),
    ]
    assert token_logprobs([5], positions[2:], 0) == [TokenLogprob(5, -0.7, ())]
