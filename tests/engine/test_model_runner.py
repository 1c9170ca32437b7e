"""How the runner groups a step's prompt spans for the SDPA prefill path."""

from __future__ import annotations

from tokenmill.engine.model_runner import MAX_PADDING_WASTE, _Span, prefill_groups


def _span(num_new: int, context_len: int) -> _Span:
    return _Span(row=0, num_new=num_new, context_len=context_len, block_table=[])


def test_a_prompts_tail_is_not_padded_to_the_next_prompts_head() -> None:
    """Seen at 8 x 2,048-token prompts: the end of one prompt (2 tokens at 2,046) beside the start
    of the next (2,044 tokens) padded into one group made each such step ~3.7x slower."""
    tail, head = _span(2, 2048), _span(2044, 2044)
    assert sorted(map(len, prefill_groups([tail, head]))) == [1, 1]


def test_like_spans_share_one_padded_call() -> None:
    """Many short prompts of about one length (a batch of 256-token prompts): one group, not one each."""
    spans = [_span(256, 256) for _ in range(6)] + [_span(250, 250), _span(241, 241)]
    groups = prefill_groups(spans)
    assert len(groups) == 1 and sorted(id(s) for s in groups[0]) == sorted(id(s) for s in spans)


def test_every_span_lands_in_exactly_one_group() -> None:
    spans = [_span(n, c) for n, c in [(7, 7), (300, 900), (2, 2000), (31, 31), (300, 880), (8, 8), (1500, 1500)]]
    grouped = [s for group in prefill_groups(spans) for s in group]
    assert sorted(map(id, grouped)) == sorted(map(id, spans))
    for group in prefill_groups(spans):
        padded = len(group) * max(s.num_new for s in group) * max(s.context_len for s in group)
        assert padded <= (1 + MAX_PADDING_WASTE) * sum(s.num_new * s.context_len for s in group) + 1e-9
