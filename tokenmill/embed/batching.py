"""Which inputs share a forward: sorted by length within a window, then cut where the batch padded
to its longest input would pass the token budget. Sorting keeps the padding (in attention only:
the linear layers run on the packed tokens) small, and a window keeps the first vectors coming
soon on a file of any size."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def length_sorted_batches(lengths: Sequence[int], max_num_batched_tokens: int, window: int) -> Iterator[list[int]]:
    """Indices into `lengths`, in batches whose count × longest fits `max_num_batched_tokens` (an input
    longer than the budget goes alone). Every index comes exactly once."""
    for start in range(0, len(lengths), window):
        order = sorted(range(start, min(start + window, len(lengths))), key=lengths.__getitem__)
        batch: list[int] = []
        for i in order:  # ascending: the input joining a batch is its longest
            if batch and (len(batch) + 1) * lengths[i] > max_num_batched_tokens:
                yield batch
                batch = []
            batch.append(i)
        if batch:
            yield batch
