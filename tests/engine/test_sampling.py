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
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _seqs(params: SamplingParams, n: int, seed: int = 0) -> list[Sequence]:
    return [
        Sequence(f"r{i}", [1, 2], params, seed=seed + i)
        for i in range(n)
    ]


def _logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(7)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    logits = _logits()
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(eos_token_ids=[])
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=0), 3)).token_ids == expected
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=1, top_k=1), 3)).token_ids == expected
    assert sampler(logits.clone(), _seqs(SamplingParams(temperature=1, top_p=1e-6), 3)).token_ids == expected


def test_top_k_and_top_p_only_draw_from_the_allowed_set() -> None:
    logits = _logits(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    sampler = Sampler(eos_token_ids=[])
    params = SamplingParams(temperature=5, top_k=3)
    drawn = {sampler(logits.clone(), _seqs(params, 1, s)).token_ids[0] for s in range(60)}
    assert drawn <= top3 and len(drawn) > 1
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    drawn = {sampler(logits.clone(), _seqs(SamplingParams(top_p=0.5), 1, s)).token_ids[0] for s in range(60)}
    assert drawn <= nucleus


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = _logits(4, 1000) / 10  # flat: many candidates
    sampler = Sampler(eos_token_ids=[])
    first = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=1)).token_ids
    again = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=1)).token_ids
    other = sampler(logits.clone(), _seqs(SamplingParams(temperature=1.0), 4, seed=99)).token_ids
    assert first == again
    assert first != other


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 10.0  # EOS is the argmax
    logits[0, 4] = 9.0  # then a stop token
    sampler = Sampler(eos_token_ids=[3])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4])
    assert sampler(logits.clone(), _seqs(params, 1)).token_ids == [0]
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits.clone(), _seqs(ignore, 1)).token_ids == [3]  # ignore_eos: EOS is just a token


def test_logprobs_are_the_untempered_distribution_and_only_for_rows_that_ask() -> None:
    logits = _logits(3)
    sampler = Sampler(eos_token_ids=[])
    seqs = [*_seqs(SamplingParams(temperature=0, logprobs=3), 1), *_seqs(SamplingParams(temperature=0), 1),
            *_seqs(SamplingParams(temperature=5, top_k=4, logprobs=0), 1, seed=3)]
    out = sampler(logits.clone(), seqs)
    expected = logits.log_softmax(-1)
    greedy, none, sampled = out.logprobs
    assert none is None
    assert greedy is not None and greedy.token_id == out.token_ids[0]
    assert greedy.logprob == pytest.approx(float(expected[0].max()))
    values, ids = expected[0].topk(3)
    assert [t for t, _ in greedy.top] == ids.tolist()
    assert [v for _, v in greedy.top] == pytest.approx(values.tolist())
    # Sampled at temperature 5 among the top 4, reported as the model's own (temperature 1) logprob.
    assert sampled is not None and sampled.top == () and sampled.token_id == out.token_ids[2]
    assert sampled.logprob == pytest.approx(float(expected[2, out.token_ids[2]]))


def test_logprobs_leave_out_what_min_tokens_suppresses() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 10.0  # EOS, suppressed before min_tokens
    out = Sampler(eos_token_ids=[3])(logits.clone(), _seqs(SamplingParams(temperature=0, min_tokens=2, logprobs=20), 1))
    [found] = out.logprobs
    assert found is not None and found.logprob == pytest.approx(-float(torch.log(torch.tensor(9.0))))
    assert len(found.top) == 9 and 3 not in {t for t, _ in found.top}  # -inf is no alternative


def test_filters_on_the_likeliest_candidates_equal_a_sort_of_the_whole_vocabulary() -> None:
    """Rows filtered on a partial sort (top_k, a top_p the candidates reach) and rows sorted whole
    (a flat distribution whose nucleus is wider than the candidates) give the distribution a full
    sort gives."""
    from tokenmill.engine.sampler import CANDIDATES, _nucleus

    torch.manual_seed(0)
    vocab = 4 * CANDIDATES
    logits = torch.randn(5, vocab) * torch.tensor([[8.0], [8.0], [0.01], [8.0], [3.0]])
    params = [SamplingParams(top_k=50), SamplingParams(top_p=0.9), SamplingParams(top_p=0.9),
              SamplingParams(top_k=40, top_p=0.5), SamplingParams(temperature=0.7)]
    seqs = [_seqs(p, 1)[0] for p in params]
    got = Sampler([0])._filtered_probs(logits.clone(), seqs)
    for row, p in enumerate(params):
        want = _nucleus((logits[row] / p.temperature).softmax(-1), p.top_k or vocab, p.top_p)
        assert torch.allclose(got[row], want, atol=1e-6), row
    assert (got[2] > 0).sum() > CANDIDATES  # the flat row's nucleus really was wider
