"""SamplingParams validation and the sampler's rules."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.sampler import Sampler
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.sequence import Sequence


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _seqs(params: SamplingParams, n: int, seed: int = 0) -> list[Sequence]:
    return [
        Sequence(f"r{i}", [1, 2], params, generator=torch.Generator().manual_seed(seed + i))
        for i in range(n)
    ]


def _logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = _logits()
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(eos_token_ids=[])
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=0), 3)) == expected
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=1, top_k=1), 3)) == expected
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=1, top_p=1e-6), 3)) == expected


def test_top_k_and_top_p_only_draw_from_the_allowed_set() -> None:
    logits = _logits(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(eos_token_ids=[])
    drawn = {sampler(logits.clone(), _seqs(SamplingParams(temperature=5, top_k=3), 1, s))[0] for s in range(60)}
    assert drawn <= top3 and len(drawn) > 1
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    drawn = {sampler(logits.clone(), _seqs(SamplingParams(top_p=0.5), 1, s))[0] for s in range(60)}
    assert drawn <= nucleus


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = _logits(4, 1000) / 10  # flat: many candidates
    sampler = Sampler(eos_token_ids=[])
    first = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=1))
    again = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=1))
    other = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=99))
    assert first == again
    assert first != other


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 10.0  # EOS is the argmax
    logits[0, 4] = 9.0  # then a stop token
    sampler = Sampler(eos_token_ids=[3])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert sampler(logits.clone(), _seqs(params, 1)) == [0]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits.clone(), _seqs(ignore, 1)) == [3]  # ignore_eos: EOS is just a token
